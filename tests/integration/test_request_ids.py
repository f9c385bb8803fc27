"""Request ids with the real worker: ``X-Request-Id`` in, on every answer out, in the logs.

(``gateway/api/request_ids.py``, ``shared/logs.py``.) That the worker knows a
request by the same id is shown by its abort lines in test_pool's
disconnect tests, which name the id the client sent.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL, Served, start_gateway, stop_serve
from tests.integration.test_pool import LONG, in_flight, raw_post, wait_for

GENERATED = re.compile(r"^[0-9a-f]{12}-\d+$")


def test_a_given_request_id_comes_back_and_names_the_response(base_url: str) -> None:
    response = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        headers={"X-Request-Id": "trace-42"},
        timeout=60,
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-42"
    assert response.json()["id"] == "chatcmpl-trace-42"  # as vllm serve names it


def test_without_one_the_gateway_makes_one_per_request(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    first = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    second = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    ids = [r.headers["x-request-id"] for r in (first, second)]
    assert all(GENERATED.match(rid) for rid in ids) and ids[0] != ids[1]
    assert first.json()["id"] == f"cmpl-{ids[0]}"


def test_streams_and_errors_carry_it_too(base_url: str) -> None:
    with httpx.stream(
        "POST",
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True},
        headers={"X-Request-Id": "stream-1"},
        timeout=60,
    ) as response:
        assert response.headers["x-request-id"] == "stream-1"
        assert '"id":"cmpl-stream-1"' in response.read().decode()
    cases = [
        ("POST", "/v1/completions", {"model": "no-such-model", "prompt": "Hi"}, 404),
        ("POST", "/v1/completions", {"model": MODEL}, 400),
        ("POST", "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": -1}}, 422),
        ("GET", "/no/such/route", None, 404),
        ("GET", "/health", None, 200),
    ]
    for method, path, body, status in cases:
        response = httpx.request(
            method, f"{base_url}{path}", json=body, headers={"X-Request-Id": "e-1"}, timeout=30
        )
        assert response.status_code == status, (path, response.text)
        assert response.headers["x-request-id"] == "e-1", path


@pytest.mark.parametrize("bad", ["x" * 129, "has space", "caf\u00e9"])
def test_a_bad_request_id_is_a_400_that_says_why(base_url: str, bad: str) -> None:
    response = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi"},
        headers={"X-Request-Id": bad.encode("utf-8")},  # type: ignore[dict-item]
        timeout=30,
    )
    assert response.status_code == 400
    assert "X-Request-Id" in response.json()["error"]["message"]
    assert GENERATED.match(response.headers["x-request-id"])  # a fresh one to quote


def test_json_logs_put_the_request_id_on_each_line_about_the_request(
    served: Served, tmp_path: Path
) -> None:
    lone = start_gateway(
        tmp_path / "gateway.log", served.worker_addresses(1), "--log-format", "json"
    )
    rid = f"json-log-{time.time_ns()}"
    try:
        with raw_post(lone.base_url, LONG, rid):
            wait_for(lambda: in_flight(lone) >= 1, timeout=60, show=lone.log_tail)
        # The client left: the gateway says so, on a line with the request's id.
        lone.wait_for_log(rid, timeout=60)
    finally:
        stop_serve(lone)
    lines = [json.loads(line) for line in lone.log_path.read_text().splitlines() if line]
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    about = [line for line in lines if line.get("request_id") == rid]
    assert any("client disconnected" in line["message"] for line in about), about
    # uvicorn's own lines come through the same formatter.
    assert any(line["logger"].startswith("uvicorn") for line in lines)
