"""The OpenAPI document describes the bodies the routes really accept."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from gateway import endpoints
from gateway.app import create_api
from gateway.dialects import schemas
from shared import routes as table
from shared.routes import Route
from shared.settings import GatewaySettings


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_api(GatewaySettings()).openapi()


def body_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    """The route's request-body schema, with its references resolvable."""
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return {**ref, "components": document["components"]}


BODIES = [(route.path, body.struct) for route, body in endpoints.BODIES.items()]


@pytest.mark.parametrize(("path", "struct"), BODIES)
def test_every_body_route_documents_its_body(
    document: dict[str, Any], path: str, struct: type
) -> None:
    operation = document["paths"][path]["post"]
    assert operation["requestBody"]["required"] is True
    name = body_schema(document, path)["$ref"].rsplit("/", 1)[1]
    assert name == struct.__name__
    assert name in document["components"]["schemas"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "m", "prompt": [[1, 2], [3]], "n": 2, "stop": "x"}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 3, "stop": ["a"]}}),
    ],
)
def test_bodies_the_gateway_accepts_validate_against_the_document(
    document: dict[str, Any], path: str, body: dict[str, Any]
) -> None:
    jsonschema.validate(body, body_schema(document, path))
    struct = dict(BODIES)[path]
    schemas.validate(body, struct)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 0}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": 5}]}),
        ("/generate", {"inputs": "hi", "parameters": {"temperature": 0}}),
    ],
)
def test_bodies_the_gateway_refuses_fail_the_document_too(
    document: dict[str, Any], path: str, body: dict[str, Any]
) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, body_schema(document, path))


def test_error_responses_use_the_routes_error_shape(document: dict[str, Any]) -> None:
    v1 = document["paths"]["/v1/completions"]["post"]["responses"]
    assert v1["429"]["content"]["application/json"]["schema"]["$ref"].endswith("/OpenAIError")
    generate = document["paths"]["/generate"]["post"]["responses"]
    assert generate["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/TgiError")
    assert endpoints.dialect_of("/generate") == "tgi"


@pytest.mark.parametrize("route", endpoints.BODIES, ids=lambda route: route.path)
def test_each_route_documents_how_it_answers(document: dict[str, Any], route: Route) -> None:
    streams = endpoints.BODIES[route].streams
    ok = document["paths"][route.path]["post"]["responses"]["200"]["content"]
    assert ("text/event-stream" in ok) == (streams != "never")
    assert ("application/json" in ok) == (streams != "always")
    assert document["paths"][route.path]["post"]["tags"] == [endpoints.tag_of(route)]


def test_the_document_has_every_route_and_method_of_the_table(document: dict[str, Any]) -> None:
    documented = {
        (path, method.upper()) for path, ops in document["paths"].items() for method in ops
    }
    assert documented == {(r.path, m) for r in table.ROUTES for m in r.methods}
