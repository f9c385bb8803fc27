"""The gateway's side of the route table (``shared.routes``): endpoints, bodies, errors.

Each endpoint attaches itself to its route of the table with
``@serves(routes.X)`` (``@serves(routes.X, "GET")`` on a route of several
methods). From the table and those endpoints, this module declares every
route on the FastAPI app (:func:`declare`), in the table's order, with
the OpenAPI tag of its kind. The builder routes also drive the fast path in
front of FastAPI (``gateway.api.direct``) and, through the request bodies
they parse (:data:`BODIES`), the OpenAPI document's request bodies and error
responses (``gateway.openapi``).

Every error a route answers, API-key refusals, bad request ids and
Starlette's 404/405 included, takes the shape of the route's dialect
(:func:`render`): OpenAI's ``{"error": {...}}`` on the OpenAI routes, TGI's
``{"error", "error_type"}`` (422 for a bad body) on TGI's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Literal, TypeVar

import msgspec
from fastapi import FastAPI
from starlette.responses import Response

from gateway import errors, schemas, tgi
from gateway.jsonresp import json_response
from shared import routes
from shared.routes import Dialect, Method, Route

Endpoint = Callable[..., Awaitable[Response]]
E = TypeVar("E", bound=Endpoint)


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

_endpoints: dict[tuple[Route, Method], Endpoint] = {}


def serves(route: Route, method: Method | None = None) -> Callable[[E], E]:
    """Decorator: the endpoint answers ``method`` of ``route`` (its only method
    when omitted)."""
    if method is None:
        assert len(route.methods) == 1, f"{route.path} has methods {route.methods}: name one"
        method = route.methods[0]
    assert method in route.methods, f"{method} is not a method of {route.path}"

    def attach(endpoint: E) -> E:
        assert (route, method) not in _endpoints, f"two endpoints serve {method} {route.path}"
        _endpoints[route, method] = endpoint
        return endpoint

    return attach


def endpoint_of(route: Route, method: Method) -> Endpoint:
    """The endpoint that answers ``method route``; an error if none attached itself."""
    found = _endpoints.get((route, method))
    if found is None:
        raise LookupError(f"no endpoint serves {method} {route.path}")
    return found


def served(route: Route, method: Method) -> bool:
    return (route, method) in _endpoints


def tag_of(route: Route) -> str | None:
    return _TAGS.get(route.dialect if route.kind == "builder" else route.kind)


def declare(app: FastAPI) -> None:
    """Every route of the table on ``app``, each method with its endpoint."""
    for route in routes.ROUTES:
        tag = tag_of(route)
        for method in route.methods:
            tags: list[str | Enum] | None = [tag] if tag else None
            app.add_api_route(route.path, endpoint_of(route, method), methods=[method], tags=tags)


def dialect_of(path: str) -> Dialect:
    route = routes.find(path)
    return route.dialect if route is not None else "openai"


def render(error: errors.GatewayError, path: str = "") -> Response:
    """``error`` as the response a client of ``path`` expects (TGI's or OpenAI's body)."""
    if dialect_of(path) == "tgi":
        return json_response(tgi.error_body(error), tgi.error_status(error), error.headers())
    return json_response(error.body(), error.status, error.headers())
