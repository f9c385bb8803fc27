"""Fuzzing every body route from the gateway's own OpenAPI document, against the real worker.

Bodies come from ``/openapi.json`` as the running gateway serves it
(hypothesis-jsonschema draws valid ones from each route's schema), plus
arbitrary JSON and valid bodies with one field replaced by junk. Outputs
are kept short so a few hundred requests take a minute or two. Whatever a
client sends, the answer must not be a 5xx, and afterwards the worker must
be the same process, still healthy.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from tests.conftest import MODEL, Served
from tests.integration.test_pool import wait_for

ROUTES = ["/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream", "/"]
EXAMPLES_PER_ROUTE = 40

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def worker_pids(served: Served) -> set[int]:
    children = psutil.Process(served.proc.pid).children(recursive=True)
    return {p.pid for p in children if "worker.main" in " ".join(p.cmdline())}


@pytest.fixture(scope="module")
def document(base_url: str) -> dict[str, Any]:
    response = httpx.get(f"{base_url}/openapi.json", timeout=60)
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


def cheap(route: str, body: Any) -> Any:
    """A valid body made quick to run: our model, few choices, few tokens."""
    if not isinstance(body, dict):
        return body
    if route.startswith("/v1/"):
        body["model"] = MODEL
        body["max_tokens"] = min(body.get("max_tokens") or 2, 2)
        body.pop("max_completion_tokens", None)
        if isinstance(body.get("n"), int):
            body["n"] = min(body["n"], 2)
        if isinstance(body.get("best_of"), int):
            body["best_of"] = min(body["best_of"], 2)
    else:
        body.pop("model", None)
        parameters = body.setdefault("parameters", {})
        parameters["max_new_tokens"] = min(parameters.get("max_new_tokens") or 2, 2)
    return body


def bodies(document: dict[str, Any], route: str) -> st.SearchStrategy[Any]:
    content = document["paths"][route]["post"]["requestBody"]["content"]
    schema = {**content["application/json"]["schema"], "components": document["components"]}
    valid = from_schema(schema).map(lambda body: cheap(route, body))
    junk_field = st.tuples(valid, st.text(max_size=20), json_values).map(
        lambda t: {**t[0], t[1]: t[2]} if isinstance(t[0], dict) else t[0]
    )
    return st.one_of(valid, valid, junk_field, json_values)


def send(base_url: str, route: str, body: Any) -> int:
    """Post ``body``; read a stream to its end. The status code."""
    with httpx.stream(
        "POST",
        f"{base_url}{route}",
        content=json.dumps(body),
        timeout=60,
        headers={"content-type": "application/json"},
    ) as response:
        for _ in response.iter_bytes():
            pass
        return response.status_code


def healthy_workers(served: Served) -> int:
    return int(httpx.get(f"{served.base_url}/ready", timeout=30).json()["healthy_workers"])


@pytest.mark.parametrize("route", ROUTES)
def test_no_body_gets_a_5xx(
    base_url: str, served: Served, document: dict[str, Any], route: str
) -> None:
    before = worker_pids(served)
    assert before
    statuses: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies(document, route))
    def check(body: Any) -> None:
        status = send(served.base_url, route, body)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (route, body)

    check()
    # Some requests got through, some were refused: the fuzz reached both sides.
    assert statuses.get(200), statuses
    assert any(400 <= s < 500 for s in statuses), statuses
    assert worker_pids(served) == before  # no worker crashed and was restarted
    wait_for(lambda: healthy_workers(served) == 1, timeout=60, show=served.log_tail)


def _body(route: str, field: str, value: bytes) -> bytes:
    """A valid, cheap body for ``route`` with ``field`` set to the raw JSON ``value``."""
    if route.startswith("/v1/chat"):
        base = b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]'
    elif route.startswith("/v1/"):
        base = b'{"model": "%s", "max_tokens": 2, "prompt": "Hi"'
    else:
        base = b'{"inputs": "Hi", "parameters": {"max_new_tokens": 2}'
    if b"%s" in base:
        base = base % MODEL.encode()
    return base + b', "' + field.encode() + b'": ' + value + b"}"


DEEP = 100_000
# Shapes that break parsers, each as raw bytes: nothing here may reach a 5xx.
HOSTILE: dict[str, Any] = {
    "deeply nested arrays": lambda route: _body(route, "x", b"[" * DEEP + b"]" * DEEP),
    "deeply nested objects": lambda route: _body(route, "x", b'{"a":' * DEEP + b"1" + b"}" * DEEP),
    "nesting just over the bound": lambda route: _body(route, "x", b"[" * 65 + b"]" * 65),
    "a huge integer": lambda route: _body(route, "seed", b"9" * 5000),
    "a huge float": lambda route: _body(route, "temperature", b"1e999999"),
    "a huge integer in token ids": lambda route: _body(route, "prompt", b"[" + b"9" * 30 + b"]"),
    "a huge string": lambda route: _body(route, "user", b'"' + b"a" * 4_000_000 + b'"'),
    "a huge array": lambda route: _body(route, "stop", b"[" + b'"x",' * 200_000 + b'"x"]'),
    "invalid UTF-8": lambda route: _body(route, "user", b'"\xff\xfe\xc3\x28"'),
    "a lone surrogate escape": lambda route: _body(route, "user", b'"\\ud800"'),
    "duplicate keys": lambda route: _body(route, "max_tokens", b'3, "max_tokens": 2'),
    "NaN": lambda route: _body(route, "temperature", b"NaN"),
    "a truncated body": lambda route: _body(route, "x", b"[1, 2")[:-3],
    "a NUL byte": lambda route: _body(route, "user", b'"a\x00b"'),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("route", ROUTES)
def test_hostile_bodies_get_a_clear_4xx_or_an_answer(
    base_url: str, served: Served, route: str, case: str
) -> None:
    before = worker_pids(served)
    response = httpx.post(
        f"{base_url}{route}",
        content=HOSTILE[case](route),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert response.status_code < 500, (case, response.status_code, response.text[:500])
    if response.status_code >= 400:
        # A clear message, in the route's dialect (OpenAI's or TGI's body).
        body = response.json()
        message = body["error"]["message"] if route.startswith("/v1/") else body["error"]
        assert message, body
    if "nest" in case:
        assert response.status_code in (400, 422), response.text[:500]
        assert "levels deep" in response.text
    assert worker_pids(served) == before
