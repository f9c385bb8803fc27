"""The response cache's parts on their own: keys, scope, controls, the memory LRU, failures.

End to end, with the real engine and a real Redis: tests/integration/test_cache.py.
"""

from __future__ import annotations

import pytest

from gateway import metrics
from gateway.cache import (
    Entry,
    ResponseCache,
    controls,
    in_scope,
    key_for,
    open_cache,
)
from gateway.cache import cache as cache_module
from gateway.cache.memory import MemoryStore
from shared import protocol
from shared.cache_settings import check_cache_settings
from shared.settings import CacheSettings

BODY = {"model": "m", "prompt": "Hello", "temperature": 0, "max_tokens": 8}


def test_key_ignores_what_cannot_change_the_output() -> None:
    same = {
        "max_tokens": 8,
        "temperature": 0,
        "prompt": "Hello",
        "model": "an-alias",
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "someone",
    }
    assert key_for("completion", "served", BODY) == key_for("completion", "served", same)


@pytest.mark.parametrize(
    "change",
    [{"prompt": "Hello!"}, {"temperature": 0.5}, {"max_tokens": 9}, {"logprobs": 1}, {"n": 2}],
)
def test_key_changes_with_any_field_that_can_change_the_output(change: dict[str, object]) -> None:
    assert key_for("completion", "served", BODY) != key_for(
        "completion", "served", {**BODY, **change}
    )


def test_key_names_the_served_model_and_the_kind() -> None:
    base = key_for("completion", "served", BODY)
    assert base != key_for("completion", "other", BODY)
    assert base != key_for("chat", "served", BODY)


@pytest.mark.parametrize(
    ("body", "scope", "expected"),
    [
        ({"temperature": 0}, "deterministic", True),
        ({"temperature": 0.0}, "deterministic", True),
        ({"temperature": 0.7, "seed": 3}, "deterministic", True),
        ({"temperature": 0.7}, "deterministic", False),
        ({}, "deterministic", False),
        ({"temperature": 0.7, "seed": 3}, "greedy", False),
        ({"temperature": 0}, "greedy", True),
        ({"temperature": 0.7}, "all", True),
    ],
)
def test_scope(body: dict[str, object], scope: str, expected: bool) -> None:
    assert in_scope(body, scope) is expected


@pytest.mark.parametrize(
    ("header", "read", "write"),
    [
        (None, True, True),
        ("", True, True),
        ("no-cache", False, True),
        ("No-Cache", False, True),
        ("max-age=0, no-store", False, False),
        ("no-cache, no-store", False, False),
        ("max-age=60", True, True),
    ],
)
def test_cache_control(header: str | None, read: bool, write: bool) -> None:
    wanted = controls(header)
    assert (wanted.read, wanted.write) == (read, write)


def test_settings_are_checked() -> None:
    assert check_cache_settings("", "deterministic") is None
    assert check_cache_settings("memory", "all") is None
    assert check_cache_settings("redis://localhost:6379/0", "greedy") is None
    assert "--cache" in (check_cache_settings("memcached://x", "deterministic") or "")
    assert "--cache-scope" in (check_cache_settings("memory", "sometimes") or "")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_memory_store_evicts_the_least_recently_used_past_its_byte_budget() -> None:
    store = MemoryStore(max_bytes=30)
    await store.put("a", b"x" * 10, ttl=60)
    await store.put("b", b"y" * 10, ttl=60)
    await store.put("c", b"z" * 10, ttl=60)
    assert await store.get("a") == b"x" * 10  # a is now the most recently used
    await store.put("d", b"w" * 10, ttl=60)  # over budget: b goes, not a
    assert await store.get("b") is None
    assert await store.get("a") is not None
    assert await store.get("c") is not None
    assert await store.get("d") is not None
    assert store.bytes == 30 and len(store) == 3


async def test_memory_store_refuses_an_entry_larger_than_its_budget() -> None:
    store = MemoryStore(max_bytes=30)
    await store.put("a", b"x" * 10, ttl=60)
    await store.put("huge", b"h" * 31, ttl=60)
    assert await store.get("huge") is None
    assert await store.get("a") == b"x" * 10


async def test_memory_store_forgets_an_entry_after_its_ttl() -> None:
    clock = Clock()
    store = MemoryStore(max_bytes=100, clock=clock)
    await store.put("a", b"x", ttl=10)
    clock.now += 9.9
    assert await store.get("a") == b"x"
    clock.now += 0.2
    assert await store.get("a") is None
    assert store.bytes == 0


async def test_memory_store_replacing_an_entry_counts_its_bytes_once() -> None:
    store = MemoryStore(max_bytes=100)
    await store.put("a", b"x" * 10, ttl=60)
    await store.put("a", b"y" * 20, ttl=60)
    assert store.bytes == 20 and await store.get("a") == b"y" * 20


def entry() -> Entry:
    delta = protocol.Delta(request_id="", index=0, text="Paris", finish_reason="stop")
    return Entry([delta], protocol.Usage(5, 1), "m", "fp", {"x-llmgate-model": "m"})


async def test_an_entry_round_trips() -> None:
    cache = open_cache(CacheSettings(cache="memory", cache_ttl=60, cache_max_bytes=10_000))
    assert cache is not None
    await cache.put("k", entry())
    assert await cache.get("k") == entry()
    assert await cache.get("other") is None


class BrokenStore:
    def __init__(self) -> None:
        self.calls = 0

    async def get(self, key: str) -> bytes | None:
        self.calls += 1
        raise ConnectionError("Redis is down")

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        self.calls += 1
        raise ConnectionError("Redis is down")

    async def close(self) -> None:
        pass


async def test_a_failing_backend_means_uncached_then_a_pause_before_the_next_try(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    monkeypatch.setattr(cache_module.time, "monotonic", clock)
    store = BrokenStore()
    cache = ResponseCache(store, ttl=60, scope="deterministic", name="redis://test")
    errors_before = metrics.CACHE_ERRORS.labels("get")._value.get()
    assert await cache.get("k") is None  # no exception reaches the request
    await cache.put("k", entry())
    assert store.calls == 1  # left alone after the failure
    assert metrics.CACHE_ERRORS.labels("get")._value.get() == errors_before + 1
    assert "serving uncached" in caplog.text
    clock.now += cache_module.RETRY_AFTER + 0.1
    assert await cache.get("k") is None
    assert store.calls == 2  # tried again after the pause
    assert caplog.text.count("serving uncached") == 1  # one warning per outage
