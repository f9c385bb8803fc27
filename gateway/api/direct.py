"""The API's POST routes served straight from ASGI, past FastAPI's per-request machinery.

The completion routes (OpenAI's and TGI's) are declared on FastAPI routers,
so they appear in ``/openapi.json`` like any route, but a request for one
never goes through FastAPI's app, router, dependency solving, exception
middleware and exit stacks: this app, in front of FastAPI's, finds the
endpoint by path and calls it with a plain Starlette ``Request``. That machinery cost about a
third of the gateway's CPU per request (py-spy, ``make bench-overhead
ARGS=--profile``). Every other request (health, metrics, models, docs,
unknown paths, other methods) goes on to FastAPI as before.

Errors are rendered here exactly as the app's handlers render them: one
:func:`render` for both.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway import errors, sse, tgi

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]


def render(error: errors.GatewayError, path: str = "") -> Response:
    """``error`` as the response a client of ``path`` expects (TGI's or OpenAI's body)."""
    if path in tgi.PATHS:
        return Response(
            sse.encode(tgi.error_body(error)),
            status_code=tgi.error_status(error),
            headers=error.headers(),
            media_type="application/json",
        )
    return Response(
        error.json(),
        status_code=error.status,
        headers=error.headers(),
        media_type="application/json",
    )


def post_endpoints(routers: Iterable[APIRouter]) -> dict[str, Endpoint]:
    """Path -> endpoint of every POST route of ``routers`` (each takes just the request)."""
    return {
        route.path: route.endpoint
        for router in routers
        for route in router.routes
        if isinstance(route, APIRoute) and route.methods == {"POST"}
    }


class DirectRoutes:
    """In front of the FastAPI app: POSTs to ``endpoints``' paths are served here,
    everything else (lifespan included) goes on to ``api``."""

    def __init__(self, api: FastAPI, endpoints: dict[str, Endpoint]) -> None:
        self.api = api
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.endpoints.get(scope["path"])
        if endpoint is None:
            await self.api(scope, receive, send)
            return
        scope["app"] = self.api  # as FastAPI would set it: request.app.state.pool
        try:
            response = await endpoint(Request(scope, receive))
        except errors.GatewayError as exc:
            response = render(exc, scope["path"])
        except ClientDisconnect:
            return  # gone while sending its body: nobody to answer
        except Exception:
            log.exception("unhandled error on POST %s", scope["path"])
            response = render(errors.GatewayError("Internal error in the gateway."), scope["path"])
        await response(scope, receive, send)
