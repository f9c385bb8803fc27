"""The worker's ``/metrics`` (``--metrics-port``): vLLM's ``vllm:*`` metrics for Prometheus.

The gateway never sees them: each worker serves its own, from the registry
of its process, where vLLM records them.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def start_metrics_server(port: int) -> None:
    """Serve the process's Prometheus registry on ``port``, from a thread of its own."""
    import prometheus_client

    prometheus_client.start_http_server(port)
    log.info("metrics on :%d/metrics", port)
