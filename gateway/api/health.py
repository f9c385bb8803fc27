"""Liveness and readiness, for load balancers and Kubernetes probes."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from gateway import metrics
from gateway.api.services import services_of
from gateway.dialects.jsonresp import json_response
from gateway.endpoints import Endpoints
from shared import routes


async def health(request: Request) -> Response:
    """The gateway process is up (it may still have no worker); its workers:
    healthy, of those draining (they take no new request), and known."""
    pool = services_of(request).pool
    healthy = pool.healthy_workers()
    return json_response(
        {
            "status": "ok",
            "healthy_workers": len(healthy),
            "draining_workers": sum(w.draining for w in healthy),
            "workers": pool.worker_count(),
        }
    )


async def prometheus_metrics() -> Response:
    """Prometheus exposition of the gateway's metrics (all its processes)."""
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)


async def ready(request: Request) -> Response:
    """Ready when at least one worker is healthy and the state store's first
    try has ended, and, with a shared ``--state-db``, once the store has
    answered (at start: a replica that cannot reach it takes no traffic; an
    outage later leaves it ready: only the routes that need state answer
    503): 200, else 503. A local SQLite store opens within the first try, so
    a file uploaded as soon as /ready says 200 is taken."""
    services = services_of(request)
    pool, store = services.pool, services.store
    healthy = len(pool.healthy_workers())
    waiting = not store.ready.is_set() and (store.shared or not store.tried.is_set())
    body: dict[str, object] = {"ready": healthy > 0 and not waiting, "healthy_workers": healthy}
    if waiting:
        body["state_store"] = store.problem
    return json_response(body, status=200 if body["ready"] else 503)


# What this module answers (gateway.app wires every module's table).
ENDPOINTS: Endpoints = {
    (routes.HEALTH, "GET"): health,
    (routes.METRICS, "GET"): prometheus_metrics,
    (routes.READY, "GET"): ready,
}
