"""gateway/endpoints.py: the route table's endpoints on the app, errors in each route's dialect."""

from __future__ import annotations

import json

import pytest
from starlette.responses import Response
from starlette.testclient import TestClient

from gateway import endpoints, errors
from gateway.app import ENDPOINTS, create_app
from shared import routes as table
from shared.settings import GatewaySettings


def test_every_route_and_method_has_its_endpoint() -> None:
    wired = set(ENDPOINTS)
    assert wired == {(route, method) for route in table.ROUTES for method in route.methods}


async def _endpoint() -> Response:
    return Response()


def test_the_app_will_not_wire_a_route_with_no_endpoint_or_with_two() -> None:
    every = dict(ENDPOINTS)
    del every[table.HEALTH, "GET"]
    with pytest.raises(LookupError, match="no endpoint serves GET /health"):
        endpoints.wire(every)
    with pytest.raises(AssertionError, match="two endpoints serve GET /health"):
        endpoints.wire(ENDPOINTS, {(table.HEALTH, "GET"): _endpoint})
    with pytest.raises(AssertionError, match="is not a method"):
        endpoints.wire(ENDPOINTS, {(table.HEALTH, "POST"): _endpoint})


def test_the_fast_path_serves_the_builder_routes_and_openapi_knows_their_bodies() -> None:
    builders = [route for route in table.ROUTES if route.kind == "builder"]
    assert list(endpoints.DIRECT) == builders
    assert list(endpoints.BODIES) == builders
    assert all(route.methods == ("POST",) for route in builders)


@pytest.mark.parametrize("route", endpoints.DIRECT, ids=lambda route: route.path)
def test_errors_are_rendered_in_the_routes_dialect(route: table.Route) -> None:
    response = endpoints.render(errors.BadRequest("no good", "temperature"), route.path)
    body = json.loads(bytes(response.body))
    if route.dialect == "tgi":
        assert response.status_code == 422
        assert body == {"error": "no good", "error_type": "validation"}
    else:
        assert response.status_code == 400
        assert body["error"]["message"] == "no good"
        assert body["error"]["param"] == "temperature"


@pytest.mark.parametrize("route", endpoints.DIRECT, ids=lambda route: route.path)
def test_a_model_not_ready_keeps_its_retry_after_in_every_dialect(route: table.Route) -> None:
    response = endpoints.render(errors.ModelNotReady.for_model("m", False), route.path)
    assert response.status_code == 503
    assert response.headers["retry-after"] == str(errors.NO_WORKER_RETRY_AFTER)
    body = json.loads(bytes(response.body))
    if route.dialect == "tgi":
        assert body["error_type"] == "unhealthy" and "starting" in body["error"]
    else:
        assert body["error"]["code"] == "model_not_ready"


@pytest.mark.parametrize(
    ("path", "tgi"), [("/v1/completions", False), ("/generate", True), ("/", True)]
)
def test_api_key_refusals_answer_in_the_routes_dialect(path: str, tgi: bool) -> None:
    app = create_app(GatewaySettings.of(api_keys="secret-key"))
    # No lifespan: the key check answers before anything needs the pool.
    response = TestClient(app).post(path, json={"inputs": "hi"})
    assert response.status_code == 401
    assert response.headers["x-request-id"]
    body = response.json()
    if tgi:
        assert body["error_type"] == "authentication" and "API key" in body["error"]
    else:
        assert "API key" in body["error"]["message"]


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
def test_a_wrong_method_on_a_tgi_path_answers_in_tgis_shape(path: str) -> None:
    response = TestClient(create_app(GatewaySettings())).get(path)
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    body = response.json()
    assert set(body) == {"error", "error_type"} and "Method Not Allowed" in body["error"], body


def test_a_wrong_method_on_an_openai_path_answers_in_openais_shape() -> None:
    response = TestClient(create_app(GatewaySettings())).get("/v1/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["message"] == "Method Not Allowed", response.json()
    missing = TestClient(create_app(GatewaySettings())).get("/v1/nothing-here")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "No route GET /v1/nothing-here."
