"""Every request settled once against its key with the engine's own counts, on the paths
that used to escape: a stream forwarded to vLLM's server that asked for no usage, a
stream its client left half-way, and a token limit held on the forwarded path.

A lone gateway with a YAML keys file and a state directory in front of the session's
real worker. ``return_token_ids`` sends a chat to vLLM's own server in the worker and
hands the client every token id, so what the client received is counted exactly. The
usage ledger's flush is waited for by polling ``/v1/usage``, never by sleeping.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from shared import api_keys
from tests.conftest import MODEL, Served, start_gateway, stop_serve
from tests.integration.test_pool import wait_for

# Small enough that a few 20-token answers use it up.
TOKENS_PER_MINUTE = 150


@pytest.fixture(scope="module")
def gateway(
    served: Served, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Served, dict[str, str]]]:
    directory = tmp_path_factory.mktemp("settlement")
    path = directory / "keys.yaml"
    keys = {
        "forwarded": api_keys.add(path, "forwarded"),
        "leaver": api_keys.add(path, "leaver"),
        "limited": api_keys.add(path, "limited", tokens_per_minute=TOKENS_PER_MINUTE),
    }
    started = start_gateway(
        directory / "gateway.log",
        served.worker_addresses(1),
        *("--api-keys-file", str(path), "--state-dir", str(directory / "state")),
    )
    try:
        yield started, keys
    finally:
        stop_serve(started)


def client(gateway: Served, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=gateway.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def chat(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        **extra,
    }


def events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[6:])


def total_usage(http: httpx.Client) -> dict[str, int]:
    response = http.get("/v1/usage")
    assert response.status_code == 200, response.text
    total: dict[str, int] = response.json()["total"]
    return total


def test_a_forwarded_stream_without_usage_is_counted_as_the_engine_counted_it(
    gateway: tuple[Served, dict[str, str]],
) -> None:
    served, keys = gateway
    http = client(served, keys["forwarded"])
    body = chat("Settlement: count to ten.", 6, return_token_ids=True)
    prompt_ids: list[int] = []
    token_ids: list[int] = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for value in events(response):
            # The client asked for no usage: it gets none, on no chunk.
            assert "usage" not in value, value
            prompt_ids = value.get("prompt_token_ids") or prompt_ids
            for choice in value["choices"]:
                token_ids += choice.get("token_ids") or []
    assert prompt_ids and len(token_ids) == 6
    wait_for(lambda: total_usage(http)["requests"] == 1, 60)
    total = total_usage(http)
    assert total["prompt_tokens"] == len(prompt_ids)
    assert total["completion_tokens"] == len(token_ids)


def test_a_stream_left_half_way_is_billed_what_the_engine_computed(
    gateway: tuple[Served, dict[str, str]],
) -> None:
    served, keys = gateway
    http = client(served, keys["leaver"])
    received = 0
    prompt_ids: list[int] = []
    body = chat("Settlement: tell a long story.", 200, return_token_ids=True)
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for value in events(response):
            prompt_ids = value.get("prompt_token_ids") or prompt_ids
            received += sum(len(c.get("token_ids") or []) for c in value["choices"])
            if received >= 3:
                break  # the client leaves: the connection closes mid-stream
    wait_for(lambda: total_usage(http)["requests"] == 1, 60)
    total = total_usage(http)
    # The prompt was computed, and at least every token the client received;
    # not the 200 it might have cost.
    assert total["prompt_tokens"] == len(prompt_ids)
    assert received <= total["completion_tokens"] < 200


def test_a_token_limit_holds_on_forwarded_streams(
    gateway: tuple[Served, dict[str, str]],
) -> None:
    served, keys = gateway
    http = client(served, keys["limited"])
    statuses = []
    for n in range(8):
        body = chat(f"Settlement: limit {n}.", 20, return_token_ids=True)
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            statuses.append(response.status_code)
            for _ in events(response):
                pass
        if response.status_code == 429:
            break
    # Each answer costs its prompt and 20 tokens: the key's 150 a minute run out
    # within eight of them (forwarded streams used to be settled at nothing).
    assert statuses[-1] == 429, statuses
    answered = statuses.count(200)
    wait_for(lambda: total_usage(http)["requests"] == answered, 60)
    assert total_usage(http)["completion_tokens"] == 20 * answered
