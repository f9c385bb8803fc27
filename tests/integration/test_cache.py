"""The response cache end to end: real gateways in front of the session's real worker,
in memory and in a real Redis server.

A hit must be the miss that stored it, byte for byte, but for the response's
id and creation time, whether either was streamed or not.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.conftest import MODEL, Served, gateway_pair, start_gateway, stop_serve
from tests.harness.redis_server import RedisServer

CACHE = "x-llmgate-cache"
FRESH = ("id", "created")


@pytest.fixture(scope="module")
def cached(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A gateway with an in-memory cache in front of the session's worker."""
    log = tmp_path_factory.mktemp("cache") / "gateway.log"
    gateway = start_gateway(log, served.worker_addresses(1), "--cache", "memory")
    try:
        yield gateway
    finally:
        stop_serve(gateway)


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 12,
        **extra,
    }


def unique(text: str) -> str:
    """A prompt no other test sends (the cache outlives each test)."""
    return f"{text} ({uuid.uuid4().hex[:8]})"


def post(
    gateway: Served, body: dict[str, Any], path: str = "/v1/chat/completions", **headers: str
) -> httpx.Response:
    response = httpx.post(f"{gateway.base_url}{path}", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response


def without_fresh(payload: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in payload.items() if k not in FRESH}


def events(response: httpx.Response) -> list[Any]:
    """The stream's events, parsed, without their id and creation time."""
    out: list[Any] = []
    for line in response.text.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        out.append(data if data == "[DONE]" else without_fresh(json.loads(data)))
    return out


def text_of(stream_events: list[Any]) -> str:
    parts = []
    for event in stream_events:
        if isinstance(event, dict):
            for choice in event["choices"]:
                parts.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(parts)


def metric(gateway: Served, name: str) -> float:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


# -- memory ------------------------------------------------------------------


def test_a_hit_is_the_miss_that_stored_it(cached: Served) -> None:
    body = chat(unique("What is the capital of France?"))
    miss = post(cached, body)
    hit = post(cached, body)
    assert miss.headers[CACHE] == "miss" and hit.headers[CACHE] == "hit"
    assert without_fresh(hit.json()) == without_fresh(miss.json())
    assert hit.json()["id"] != miss.json()["id"]
    assert hit.headers["x-llmgate-model"] == MODEL
    assert "x-llmgate-worker" not in hit.headers  # no worker answered it


def test_a_streamed_hit_replays_the_streamed_miss_chunk_for_chunk(cached: Served) -> None:
    body = {
        "model": MODEL,
        "prompt": unique("Once upon a time"),
        "temperature": 0,
        "max_tokens": 16,
        "logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    miss = post(cached, body, "/v1/completions")
    hit = post(cached, body, "/v1/completions")
    assert miss.headers[CACHE] == "miss" and hit.headers[CACHE] == "hit"
    assert hit.headers["content-type"].startswith("text/event-stream")
    miss_events, hit_events = events(miss), events(hit)
    assert len(miss_events) >= 4 and miss_events[-1] == "[DONE]"
    assert hit_events == miss_events
    assert "usage" in hit_events[-2]


def test_a_streamed_miss_serves_a_whole_hit_and_the_other_way_round(cached: Served) -> None:
    streamed = chat(unique("Name three colours."), stream=True)
    miss = post(cached, streamed)
    whole_hit = post(cached, {**streamed, "stream": False})
    assert whole_hit.headers[CACHE] == "hit"
    assert whole_hit.json()["choices"][0]["message"]["content"] == text_of(events(miss))

    whole = chat(unique("Name three animals."))
    miss = post(cached, whole)
    stream_hit = post(cached, {**whole, "stream": True})
    assert stream_hit.headers[CACHE] == "hit"
    stream_events = events(stream_hit)
    assert stream_events[-1] == "[DONE]"
    assert text_of(stream_events) == miss.json()["choices"][0]["message"]["content"]
    finish = miss.json()["choices"][0]["finish_reason"]
    assert stream_events[-2]["choices"][0]["finish_reason"] == finish


def test_fields_that_cannot_change_the_output_share_an_entry(cached: Served) -> None:
    body = chat(unique("Say hello."))
    post(cached, body)
    hit = post(cached, {**body, "user": "someone-else", "stream_options": None})
    assert hit.headers[CACHE] == "hit"
    other = post(cached, {**body, "max_tokens": 11})
    assert other.headers[CACHE] == "miss"


def test_no_cache_recomputes_and_stores(cached: Served) -> None:
    body = chat(unique("What is two plus two?"))
    first = post(cached, body)
    refreshed = post(cached, body, **{"Cache-Control": "no-cache"})
    assert refreshed.headers[CACHE] == "miss"
    assert "x-llmgate-worker" in refreshed.headers  # a worker computed it
    hit = post(cached, body)
    assert hit.headers[CACHE] == "hit"
    assert without_fresh(hit.json()) == without_fresh(refreshed.json())
    assert first.json()["choices"] == hit.json()["choices"]


def test_no_store_neither_reads_nor_stores(cached: Served) -> None:
    body = chat(unique("What is the largest ocean?"))
    post(cached, body)
    bypass = post(cached, body, **{"Cache-Control": "no-store"})
    assert bypass.headers[CACHE] == "bypass" and "x-llmgate-worker" in bypass.headers

    never_stored = chat(unique("What is the smallest ocean?"))
    post(cached, never_stored, **{"Cache-Control": "no-store"})
    assert post(cached, never_stored).headers[CACHE] == "miss"


def test_sampled_requests_without_a_seed_are_not_cached(cached: Served) -> None:
    sampled = chat(unique("Tell me a joke."), temperature=0.8)
    assert post(cached, sampled).headers[CACHE] == "bypass"
    assert post(cached, sampled).headers[CACHE] == "bypass"
    seeded = {**sampled, "seed": 42}
    assert post(cached, seeded).headers[CACHE] == "miss"
    assert post(cached, seeded).headers[CACHE] == "hit"


def test_failed_requests_are_not_stored(cached: Served) -> None:
    body = {"model": MODEL, "prompt": unique("x"), "temperature": 0, "max_tokens": 100_000}
    for _ in range(2):
        response = httpx.post(f"{cached.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
    fine = {**body, "max_tokens": 4}
    assert post(cached, fine, "/v1/completions").headers[CACHE] == "miss"


def test_hits_and_misses_are_counted(cached: Served) -> None:
    before = {r: metric(cached, f'llmgate_cache_requests_total{{result="{r}"}}') for r in ("hit",)}
    body = chat(unique("Count to three."))
    post(cached, body)
    post(cached, body)
    assert metric(cached, 'llmgate_cache_requests_total{result="hit"}') == before["hit"] + 1
    assert metric(cached, "llmgate_cache_bytes") > 0


def test_the_memory_cache_keeps_to_its_byte_budget(served: Served, tmp_path: Path) -> None:
    budget = 1500
    gateway = start_gateway(
        tmp_path / "gateway.log",
        served.worker_addresses(1),
        *("--cache", "memory", "--cache-max-bytes", str(budget)),
    )
    try:
        bodies = [chat(unique(f"Write the number {i} in words.")) for i in range(12)]
        for body in bodies:
            assert post(gateway, body).headers[CACHE] == "miss"
        assert 0 < metric(gateway, "llmgate_cache_bytes") <= budget
        # The most recent answer is kept; the first, least recently used, is gone.
        assert post(gateway, bodies[-1]).headers[CACHE] == "hit"
        assert post(gateway, bodies[0]).headers[CACHE] == "miss"
    finally:
        stop_serve(gateway)


# -- Redis -------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_gateways(
    served: Served, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Served, Served]]:
    """Two gateway processes sharing one Redis, in front of the session's worker."""
    directory = tmp_path_factory.mktemp("redis-gateways")
    flags = ("--cache", redis_server.url, "--cache-ttl", "600")
    with gateway_pair(served, directory, *flags) as both:
        yield both


def test_two_gateways_share_hits_through_redis(two_gateways: tuple[Served, Served]) -> None:
    first, second = two_gateways
    body = chat(unique("What is the capital of Italy?"), stream=True)
    miss = post(first, body)
    hit = post(second, body)
    assert miss.headers[CACHE] == "miss" and hit.headers[CACHE] == "hit"
    assert events(hit) == events(miss)


def test_redis_entries_carry_the_ttl(
    two_gateways: tuple[Served, Served], redis_server: RedisServer
) -> None:
    first, _ = two_gateways
    client = redis.Redis.from_url(redis_server.url)
    before = set(client.scan_iter("llmgate:cache:*"))
    post(first, chat(unique("What is the capital of Spain?")))
    (key,) = set(client.scan_iter("llmgate:cache:*")) - before
    assert 0 < client.pttl(key) <= 600_000


def test_requests_succeed_uncached_while_redis_is_down(
    two_gateways: tuple[Served, Served], redis_server: RedisServer
) -> None:
    first, _ = two_gateways
    errors_before = metric(first, "llmgate_cache_errors_total")
    redis_server.stop()
    try:
        body = chat(unique("What is the capital of Germany?"))
        for _ in range(3):
            response = post(first, body)
            assert response.headers[CACHE] == "miss"
            assert "Berlin" in response.json()["choices"][0]["message"]["content"]
        assert metric(first, "llmgate_cache_errors_total") > errors_before
        first.wait_for_log("serving uncached")
    finally:
        redis_server.start()
    # Back: the gateway tries Redis again after a pause, on a later request.
    probe = chat(unique("What is the capital of Austria?"))
    deadline = time.monotonic() + 60
    while "is back" not in first.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, first.log_tail()
        post(first, probe, **{"Cache-Control": "no-cache"})
    body = chat(unique("What is the capital of Portugal?"))
    assert post(first, body).headers[CACHE] == "miss"
    assert post(first, body).headers[CACHE] == "hit"
