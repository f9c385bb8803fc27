"""Container health check for the llmgate images: ``healthcheck.py gateway|worker``.

Standard library only, so it runs in every image without adding a package.

* ``gateway``: ``GET /health`` on ``$LLMGATE_PORT`` (the process serves HTTP;
  it may have no worker yet, which is readiness, not health).
* ``worker``: ``GET /metrics`` on ``$LLMGATE_METRICS_PORT``. The worker starts
  that server only after its engine loaded and its ZeroMQ socket is bound, so
  an answer means the worker came up. With the port set to 0 there is nothing
  to ask, and the check passes while the process runs.

Exit status 0 is healthy, 1 is not (Docker's HEALTHCHECK convention).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TARGETS = {
    "gateway": ("LLMGATE_PORT", "8000", "/health"),
    "worker": ("LLMGATE_METRICS_PORT", "0", "/metrics"),
}


def url_for(kind: str, environ: dict[str, str]) -> str | None:
    """The URL to probe for ``kind``, or None when there is nothing to probe."""
    variable, default, path = TARGETS[kind]
    port = environ.get(variable, default)
    if int(port) == 0:
        return None
    return f"http://127.0.0.1:{int(port)}{path}"


def probe(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status: int = response.status
            return 200 <= status < 300
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in TARGETS:
        print(f"usage: healthcheck.py {'|'.join(TARGETS)}", file=sys.stderr)
        return 2
    url = url_for(argv[0], dict(os.environ))
    if url is None:
        return 0
    if probe(url):
        return 0
    print(f"unhealthy: no 2xx from {url}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
