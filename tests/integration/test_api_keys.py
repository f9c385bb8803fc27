"""API keys end to end: a lone gateway with ``--api-keys`` in front of the session's worker."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import MODEL, Served, start_gateway, stop_serve

KEY_1 = "sk-llmgate-test-key-one"
KEY_2 = "sk-llmgate-test-key-two"
FILE_KEY = "sk-llmgate-test-key-from-file"
ADMIN_KEY = "sk-llmgate-test-admin-key"

# (method, path, JSON body) of every protected route; small requests, one token.
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 1}),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    ),
    ("POST", "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 1}}),
]
ROUTE_IDS = [path for _, path, _ in ROUTES]


@pytest.fixture(scope="module")
def keyed(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log_path = tmp_path_factory.mktemp("api-keys") / "gateway.log"
    gateway = start_gateway(log_path, served.worker_addresses(), "--api-keys", f"{KEY_1},{KEY_2}")
    try:
        yield gateway
    finally:
        stop_serve(gateway)


@pytest.fixture(scope="module")
def keyed_client(keyed: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed.base_url, timeout=120) as client:
        yield client


def call(
    client: httpx.Client, route: tuple[str, str, dict[str, Any] | None], headers: dict[str, str]
) -> httpx.Response:
    method, path, body = route
    return client.request(method, path, json=body, headers=headers)


def assert_401(response: httpx.Response) -> None:
    """401 in the route's dialect: TGI's error body on TGI's routes, OpenAI's elsewhere."""
    assert response.status_code == 401, response.text
    assert response.headers["x-request-id"]
    if response.request.url.path == "/generate":
        message = response.json()["error"]
        assert response.json() == {"error": message, "error_type": "authentication"}
        assert "API key" in message
        return
    assert response.json() == {
        "error": {
            "message": response.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_no_key_is_401(keyed_client: httpx.Client, route: tuple[str, str, Any]) -> None:
    assert_401(call(keyed_client, route, {}))


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_a_wrong_key_is_401(keyed_client: httpx.Client, route: tuple[str, str, Any]) -> None:
    assert_401(call(keyed_client, route, {"Authorization": "Bearer sk-llmgate-wrong"}))
    assert_401(call(keyed_client, route, {"Authorization": f"Bearer {KEY_1[:-1]}"}))


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("key", [KEY_1, KEY_2])
def test_a_right_key_is_let_through(
    keyed_client: httpx.Client, route: tuple[str, str, Any], key: str
) -> None:
    response = call(keyed_client, route, {"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


def test_the_openai_sdk_works_with_its_api_key(keyed: Served) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=KEY_2)
    assert [m.id for m in client.models.list()] == [MODEL]
    wrong = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_probes_stay_open(keyed_client: httpx.Client, path: str) -> None:
    assert keyed_client.get(path).status_code == 200


def test_metrics_take_an_admin_key_and_a_plain_one_is_none(keyed_client: httpx.Client) -> None:
    """/metrics was open to anyone (unless --protect-metrics)."""
    assert_401(keyed_client.get("/metrics"))
    refused = keyed_client.get("/metrics", headers={"Authorization": f"Bearer {KEY_1}"})
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["type"] == "invalid_request_error"


def test_keys_never_reach_the_log(keyed: Served, keyed_client: httpx.Client) -> None:
    for key in (KEY_1, "sk-llmgate-wrong-key-in-log"):
        keyed_client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    log = keyed.log_path.read_text(errors="replace")
    assert "API keys: 2 configured" in log
    for secret in (KEY_1, KEY_2, "sk-llmgate-wrong-key-in-log"):
        assert secret not in log


# Header values an HTTP client can send: visible Latin-1 and spaces/tabs, no CR/LF.
_HEADER_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=120,
)
_NEAR_KEYS = st.builds(
    lambda scheme, gap, key, tail: f"{scheme}{gap}{key}{tail}",
    st.sampled_from(["Bearer ", "bearer ", "BEARER", "Basic ", ""]),
    st.sampled_from(["", " ", "  ", "\t"]),
    st.sampled_from([KEY_1, KEY_2, KEY_1.upper(), KEY_1[:-1], KEY_2 + "x", ""]),
    st.sampled_from(["", " ", ",", "\t", "é"]),
)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# HTTP clients refuse a value with spaces or tabs at either end.
@given(value=st.one_of(_HEADER_TEXT, _NEAR_KEYS).map(lambda v: v.strip(" \t")))
def test_a_fuzzed_authorization_header_never_gets_a_5xx(
    keyed_client: httpx.Client, value: str
) -> None:
    raw = value.encode("latin-1")
    response = keyed_client.get("/v1/models", headers={"Authorization": raw})
    scheme, _, token = raw.partition(b" ")
    right = scheme.lower() == b"bearer" and token.strip(b" \t") in (KEY_1.encode(), KEY_2.encode())
    assert response.status_code == (200 if right else 401), (value, response.text)


@pytest.fixture(scope="module")
def metrics_keyed(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("api-keys-file")
    keys_file = folder / "keys.yaml"
    keys_file.write_text(
        "# issued to the test suite\n"
        f"keys:\n  - {{name: team, key: {FILE_KEY}}}\n"
        f"  - {{name: prometheus, key: {ADMIN_KEY}, admin: true}}\n"
    )
    gateway = start_gateway(
        folder / "gateway.log",
        served.worker_addresses(),
        # Deprecated: still accepted, and changes nothing.
        *("--api-keys-file", str(keys_file), "--protect-metrics"),
    )
    try:
        yield gateway
    finally:
        stop_serve(gateway)


def test_a_keys_file_and_metrics_for_its_admin_key(metrics_keyed: Served) -> None:
    url = metrics_keyed.base_url
    assert_401(httpx.get(f"{url}/metrics", timeout=60))
    with_key = {"Authorization": f"Bearer {FILE_KEY}"}
    assert httpx.get(f"{url}/metrics", headers=with_key, timeout=60).status_code == 403
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(f"{url}/metrics", headers=admin, timeout=60).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers=with_key, timeout=60).status_code == 200
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    assert httpx.get(f"{url}/ready", timeout=60).status_code == 200
    assert "--protect-metrics (LLMGATE_PROTECT_METRICS) is deprecated" in (
        metrics_keyed.log_path.read_text(errors="replace")
    )


def test_a_name_in_both_the_flag_and_the_file_stops_the_gateway(tmp_path: Path) -> None:
    """Two keys with one name would show as one in usage and metrics."""
    import hashlib
    import subprocess
    import sys

    name = "key-" + hashlib.sha256(KEY_1.encode()).hexdigest()[:8]  # the flag key's name
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"keys:\n  - {{name: {name}, key: sk-llmgate-another}}\n")
    done = subprocess.run(
        [sys.executable, "-m", "gateway.main", "--api-keys-file", str(keys_file)],
        env={**os.environ, "LLMGATE_API_KEYS": KEY_1},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"the name {name!r} is in both --api-keys and --api-keys-file" in done.stderr
    assert KEY_1 not in done.stderr


def test_a_gateway_with_an_empty_keys_file_refuses_to_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    keys_file = tmp_path / "keys"
    keys_file.write_text("# nothing yet\n")
    done = subprocess.run(
        [sys.executable, "-m", "gateway.main", "--api-keys-file", str(keys_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "holds no key" in done.stderr
