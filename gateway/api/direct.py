"""The API's POST routes served straight from ASGI, past FastAPI's per-request machinery.

The builder routes of the route table (``shared.routes``) are declared on
the FastAPI app too, so they appear in ``/openapi.json`` like any route, but a request for
one never goes through FastAPI's app, router, dependency solving, exception
middleware and exit stacks: this app, in front of FastAPI's, finds the
endpoint by path and calls it with a plain Starlette ``Request``: that
machinery was a large share of the gateway's CPU per request
(docs/benchmark-history.md). Every other request (health,
metrics, models, docs, unknown paths, other methods) goes on to FastAPI.

Errors are rendered here exactly as the app's handlers render them: one
:func:`gateway.endpoints.render` for both.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from gateway import errors
from gateway.api.request_ids import HEADER, assign
from gateway.endpoints import DIRECT, Endpoint, Endpoints, render

log = logging.getLogger(__name__)


class DirectRoutes:
    """In front of the FastAPI app: POSTs to the builder routes' paths are served
    here, everything else (lifespan included) goes on to ``api``."""

    def __init__(self, api: FastAPI, endpoints: Endpoints) -> None:
        self.api = api
        self.endpoints: dict[str, Endpoint] = {
            route.path: endpoints[route, "POST"] for route in DIRECT
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.endpoints.get(scope["path"])
        if endpoint is None:
            await self.api(scope, receive, send)
            return
        scope["app"] = self.api  # as FastAPI would set it: request.app.services
        # The request's log lines name its id explicitly (extra=...): setting
        # shared.logs' context variable here cost ~6% of the gateway's
        # requests/s (make bench-overhead), for the few lines a request logs.
        rid, bad = assign(scope)
        try:
            if bad is not None:
                raise bad
            response = await endpoint(Request(scope, receive))
        except errors.GatewayError as exc:
            response = render(exc, scope["path"])
        except ClientDisconnect:
            return  # gone while sending its body: nobody to answer
        except Exception:
            log.exception("unhandled error on POST %s", scope["path"], extra={"request_id": rid})
            response = render(errors.GatewayError("Internal error in the gateway."), scope["path"])
        response.raw_headers.append((HEADER, rid.encode()))
        await response(scope, receive, send)
