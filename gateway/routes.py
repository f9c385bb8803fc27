"""The API's POST routes, each written once: path, body, streaming, error dialect.

This table drives the fast path in front of FastAPI (``gateway.api.direct``),
the routes FastAPI declares (for ``/openapi.json``), the OpenAPI document's
request bodies and error responses (``gateway.openapi``), and the shape of
every error a route answers, API-key refusals and bad request ids included
(``render``): OpenAI's ``{"error": {...}}`` on the OpenAI routes, TGI's
``{"error", "error_type"}`` (422 for a bad body) on TGI's.

Each endpoint attaches itself to its route with ``@ROUTE.serves``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway import errors, schemas, sse, tgi

Endpoint = Callable[[Request], Awaitable[Response]]
Dialect = Literal["openai", "tgi"]


@dataclass(eq=False, slots=True)
class Route:
    path: str
    body: type[msgspec.Struct]
    # Whether it answers with server-sent events: always, never, or when the body asks.
    streams: Literal["always", "never", "if asked"]
    dialect: Dialect
    tag: str
    endpoint: Endpoint | None = None

    def serves(self, endpoint: Endpoint) -> Endpoint:
        """Decorator: ``endpoint`` answers this route."""
        self.endpoint = endpoint
        return endpoint


COMPLETIONS = Route("/v1/completions", schemas.CompletionRequest, "if asked", "openai", "OpenAI")
CHAT = Route("/v1/chat/completions", schemas.ChatCompletionRequest, "if asked", "openai", "OpenAI")
TGI_GENERATE = Route("/generate", tgi.GenerateRequest, "never", "tgi", "TGI")
TGI_GENERATE_STREAM = Route("/generate_stream", tgi.GenerateRequest, "always", "tgi", "TGI")
# TGI's compatibility route, the one its Python client posts to.
TGI_COMPAT = Route("/", tgi.GenerateRequest, "if asked", "tgi", "TGI")

ROUTES = (COMPLETIONS, CHAT, TGI_GENERATE, TGI_GENERATE_STREAM, TGI_COMPAT)
BY_PATH = {route.path: route for route in ROUTES}


def dialect_of(path: str) -> Dialect:
    route = BY_PATH.get(path)
    return route.dialect if route is not None else "openai"


def render(error: errors.GatewayError, path: str = "") -> Response:
    """``error`` as the response a client of ``path`` expects (TGI's or OpenAI's body)."""
    if dialect_of(path) == "tgi":
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
