"""Liveness and readiness, for load balancers and Kubernetes probes."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from gateway import metrics
from gateway.pool import Pool
from gateway.routes import serves
from gateway.sse import encode
from shared import routes


@serves(routes.HEALTH)
async def health(request: Request) -> Response:
    """The gateway process is up (it may still have no worker)."""
    pool: Pool = request.app.state.pool
    return Response(
        encode(
            {
                "status": "ok",
                "healthy_workers": len(pool.healthy_workers()),
                "workers": pool.worker_count(),
            }
        ),
        media_type="application/json",
    )


@serves(routes.METRICS)
async def prometheus_metrics() -> Response:
    """Prometheus exposition of the gateway's metrics (all its processes)."""
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)


@serves(routes.READY)
async def ready(request: Request) -> Response:
    """Ready when at least one worker is healthy: 200, else 503."""
    pool: Pool = request.app.state.pool
    healthy = len(pool.healthy_workers())
    return Response(
        encode({"ready": healthy > 0, "healthy_workers": healthy}),
        status_code=200 if healthy else 503,
        media_type="application/json",
    )
