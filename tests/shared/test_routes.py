"""shared/routes.py: one route table, and everything built from it agrees with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from starlette.routing import compile_path
from starlette.types import Receive, Scope, Send

from gateway.api import auth
from gateway.app import create_api
from gateway.batch import jsonl
from shared import routes
from shared.routes import ROUTES, Route
from shared.settings import GatewaySettings
from worker import passthrough, vllm_app

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [(route.path, method) for route in ROUTES for method in route.methods]


def concrete(route: Route, value: str = "abc") -> str:
    """The route's path with every parameter filled in."""
    return route.url(**dict.fromkeys(route.params, value))


def by_id(route: Route) -> str:
    return route.path


def test_paths_are_unique_and_so_are_path_and_method() -> None:
    assert len({route.path for route in ROUTES}) == len(ROUTES)
    assert len(set(PAIRS)) == len(PAIRS)
    assert all(route.methods for route in ROUTES)


@pytest.mark.parametrize("route", ROUTES, ids=by_id)
def test_a_path_is_starlettes_syntax_and_matches_as_starlette_does(route: Route) -> None:
    assert route.path.startswith("/")
    assert re.fullmatch(r"(/[a-z0-9_]*|/\{[a-z_]+\})+|/", route.path), route.path
    regex, _, _ = compile_path(route.path)
    for path in (concrete(route), concrete(route) + "/more", route.path.replace("{", "")):
        assert route.matches(path) == bool(regex.match(path)), path


@pytest.mark.parametrize("route", ROUTES, ids=by_id)
def test_find_answers_each_route_for_its_concrete_path(route: Route) -> None:
    assert routes.find(concrete(route)) == route


def test_find_tells_the_routes_with_parameters_apart() -> None:
    assert routes.find("/v1/files/file-1/content") == routes.FILE_CONTENT
    assert routes.find("/v1/files/file-1") == routes.FILE
    assert routes.find("/v1/responses/resp-1/cancel") == routes.RESPONSE_CANCEL
    for unknown in ("/v1/nothing", "/v1/responses/", "/v1/responses/a/b", "/generate/"):
        assert routes.find(unknown) is None, unknown


def test_url_fills_the_parameters_in() -> None:
    assert routes.BATCH.url(batch_id="batch_1") == "/v1/batches/batch_1"
    assert routes.BATCH.params == ("batch_id",)


def test_the_fastapi_app_declares_exactly_the_table() -> None:
    app = create_api(GatewaySettings())
    declared = [
        (route.path, method)
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    ]
    assert sorted(declared) == sorted(PAIRS)


def test_the_worker_allows_exactly_the_forwarded_routes() -> None:
    assert {route for route in ROUTES if route.forwarded} == vllm_app.FORWARDED
    for route in ROUTES:
        for method in ("GET", "POST", "DELETE"):
            expected = route.forwarded and method in route.methods
            assert vllm_app.allowed(method, concrete(route)) == expected, (method, route.path)


def test_the_forwarded_routes_are_those_the_worker_always_allowed() -> None:
    """Pinned: the worker's allow-list before it came from the table."""
    assert {route.path for route in vllm_app.FORWARDED} == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/tokenize",
        "/detokenize",
        "/version",
        "/ping",
        "/invocations",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
    assert vllm_app.allowed("GET", "/v1/responses/resp-1")
    assert vllm_app.allowed("POST", "/v1/responses/resp-1/cancel")
    for method, path in [
        ("GET", "/v1/responses/"),
        ("GET", "/v1/responses/a/b"),
        ("POST", "/v1/responses//cancel"),
        ("GET", "/v1/responses/resp-1/cancel"),
        ("GET", "/metrics"),
        ("POST", "/v1/batches"),
    ]:
        assert not vllm_app.allowed(method, path), (method, path)


def test_the_generation_routes_are_the_forwarded_completion_and_chat() -> None:
    assert passthrough.GENERATION_ROUTES == {
        routes.COMPLETIONS.path: "completion",
        routes.CHAT.path: "chat",
    }
    for route in ROUTES:
        if route.generates is not None:
            assert route.forwarded and route.kind == "builder" and route.methods == ("POST",)


def test_a_batch_runs_the_batchable_routes() -> None:
    assert jsonl.ENDPOINTS == ("/v1/chat/completions", "/v1/completions")
    for route in ROUTES:
        if route.batchable:
            assert route.methods == ("POST",) and route.dialect == "openai"
            assert route.generates is not None  # the runner's lines go through the builders


def test_the_probes_are_open_and_metrics_for_admin_keys_only() -> None:
    assert routes.open_paths() == {"/health", "/ready"}
    assert routes.admin_paths() == {"/metrics"}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        pass

    middleware = auth.ApiKeyMiddleware(app, keys=["k"])
    assert (middleware._open, middleware._admin) == (routes.open_paths(), routes.admin_paths())
    for route in ROUTES:
        if route.key != "always":
            assert route.kind == "ops" and not route.params and route.methods == ("GET",)


def test_only_builder_routes_speak_tgi() -> None:
    assert all(route.kind == "builder" for route in ROUTES if route.dialect == "tgi")


@pytest.mark.parametrize("route", [r for r in ROUTES if r.path != "/"], ids=by_id)
def test_each_path_is_written_once_in_the_code(route: Route) -> None:
    """gateway/, worker/ and shared/ name a route by the table, never by its path."""
    quoted = f'"{route.path}"'
    found = [
        str(source.relative_to(ROOT))
        for package in ("gateway", "worker", "shared")
        for source in sorted((ROOT / package).rglob("*.py"))
        for _ in range(source.read_text().count(quoted))
    ]
    assert found == ["shared/routes.py"], found
