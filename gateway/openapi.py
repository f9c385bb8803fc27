"""The OpenAPI document: FastAPI's, plus the request bodies the routes parse themselves.

The API routes read their bodies with msgspec (``gateway.dialects.schemas``,
``gateway.dialects.tgi``) rather than through FastAPI's pydantic parameters, so FastAPI
cannot see them. This module writes those same structs, as the builder routes
name them (``gateway.endpoints.BODIES``), into the document as JSON Schema
components, so ``/openapi.json`` describes exactly what the gateway accepts,
and adds the error responses every API route can give, in its dialect.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway.endpoints import BODIES

REF = "#/components/schemas/{name}"


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct):
    """OpenAI's error body, on the /v1 routes."""

    error: OpenAIErrorDetail


class TgiError(msgspec.Struct):
    """TGI's error body, on its generate routes."""

    error: str
    error_type: str


_ERRORS = {
    "400": "The body is not valid: the message names the field (422 on TGI routes).",
    "401": "No or a wrong API key.",
    "404": "A model nobody declared and no worker serves.",
    "413": "The body is larger than --max-body-bytes.",
    "429": "The queue is full or the wait timed out; see Retry-After.",
    "502": "The worker was lost and the request could not be retried.",
    "503": "No healthy worker serves the model yet (starting) or now; see Retry-After.",
    "504": "The request ran past its deadline.",
}


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` return the completed document (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    types = [*dict.fromkeys(body.struct for body in BODIES.values()), OpenAIError, TgiError]
    refs, components = msgspec.json.schema_components(types, ref_template=REF)
    document.setdefault("components", {}).setdefault("schemas", {}).update(components)
    ref_of = dict(zip(types, refs, strict=True))
    for route, body in BODIES.items():
        operation = document["paths"][route.path]["post"]
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": ref_of[body.struct]}},
        }
        tgi = route.dialect == "tgi"
        error_ref = ref_of[TgiError if tgi else OpenAIError]
        responses = operation.setdefault("responses", {})
        responses.pop("422", None)  # FastAPI's own validation error: never raised here
        ok = responses.setdefault("200", {"description": "Successful Response"})
        ok["content"] = {}
        if body.streams != "always":
            ok["content"]["application/json"] = {"schema": {"type": "object"}}
        if body.streams != "never":
            ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
        for status, description in _ERRORS.items():
            if tgi and status == "400":
                status = "422"
            responses[status] = {
                "description": description,
                "content": {"application/json": {"schema": error_ref}},
            }
    return document
