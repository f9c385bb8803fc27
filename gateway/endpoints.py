"""The gateway's side of the route table (``shared.routes``): endpoints, bodies, errors.

Each API module lists its endpoints by route of the table and method (its
``ENDPOINTS``); the app joins those lists in one place (:func:`wire`,
called by ``gateway.app``), which fails at start if a method of the table
has no endpoint or two. This module declares every route on the FastAPI
app from them (:func:`declare`), in the table's order, with the OpenAPI tag
of its kind. The builder routes also drive the fast path in
front of FastAPI (``gateway.api.direct``) and, through the request bodies
they parse (:data:`BODIES`), the OpenAPI document's request bodies and error
responses (``gateway.openapi``).

Every error a route answers, API-key refusals, bad request ids and
Starlette's 404/405 included, takes the shape of the route's dialect
(:func:`render`): OpenAI's ``{"error": {...}}`` on the OpenAI routes, TGI's
``{"error", "error_type"}`` (422 for a bad body) on TGI's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Literal

import msgspec
from fastapi import FastAPI
from starlette.responses import Response

from gateway import errors
from gateway.dialects import schemas, tgi
from gateway.dialects.jsonresp import json_response
from shared import routes
from shared.routes import Dialect, Method, Route

Endpoint = Callable[..., Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class Body:
    """What a builder route parses (with msgspec, so FastAPI cannot see it)."""

    struct: type[msgspec.Struct]
    # Whether it answers with server-sent events: always, never, or when the body asks.
    streams: Literal["always", "never", "if asked"]


BODIES: dict[Route, Body] = {
    routes.COMPLETIONS: Body(schemas.CompletionRequest, "if asked"),
    routes.CHAT: Body(schemas.ChatCompletionRequest, "if asked"),
    routes.TGI_GENERATE: Body(tgi.GenerateRequest, "never"),
    routes.TGI_GENERATE_STREAM: Body(tgi.GenerateRequest, "always"),
    routes.TGI_COMPAT: Body(tgi.GenerateRequest, "if asked"),
}

# The builder routes: their POSTs are served in front of FastAPI (gateway.api.direct).
DIRECT = tuple(route for route in routes.ROUTES if route.kind == "builder")
DIRECT_PATHS = frozenset(route.path for route in DIRECT)

# /openapi.json's sections: the builder routes by dialect, the others by kind.
_TAGS: dict[str, str] = {
    "openai": "OpenAI",
    "tgi": "TGI",
    "vllm": "vLLM",
    "batch": "Batch",
    "usage": "Usage",
}

# Each API module's endpoints, by route of the table and method.
Endpoints = Mapping[tuple[Route, Method], Endpoint]


def wire(*tables: Endpoints) -> dict[tuple[Route, Method], Endpoint]:
    """The API modules' endpoint tables as one: every method of every route of
    the route table, each answered by one endpoint (an error otherwise)."""
    wired: dict[tuple[Route, Method], Endpoint] = {}
    for table in tables:
        for (route, method), endpoint in table.items():
            assert method in route.methods, f"{method} is not a method of {route.path}"
            assert (route, method) not in wired, f"two endpoints serve {method} {route.path}"
            wired[route, method] = endpoint
    missing = [
        f"{method} {route.path}"
        for route in routes.ROUTES
        for method in route.methods
        if (route, method) not in wired
    ]
    if missing:
        raise LookupError(f"no endpoint serves {', '.join(missing)}")
    return wired


def tag_of(route: Route) -> str | None:
    return _TAGS.get(route.dialect if route.kind == "builder" else route.kind)


def declare(app: FastAPI, endpoints: Endpoints) -> None:
    """Every route of the table on ``app``, each method with its endpoint (:func:`wire`)."""
    for route in routes.ROUTES:
        tag = tag_of(route)
        for method in route.methods:
            tags: list[str | Enum] | None = [tag] if tag else None
            endpoint = endpoints[route, method]
            app.add_api_route(route.path, endpoint, methods=[method], tags=tags)


def dialect_of(path: str) -> Dialect:
    route = routes.find(path)
    return route.dialect if route is not None else "openai"


def render(error: errors.GatewayError, path: str = "") -> Response:
    """``error`` as the response a client of ``path`` expects (TGI's or OpenAI's body)."""
    if dialect_of(path) == "tgi":
        return json_response(tgi.error_body(error), tgi.error_status(error), error.headers())
    return json_response(error.body(), error.status, error.headers())
