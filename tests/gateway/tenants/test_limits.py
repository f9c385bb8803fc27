"""gateway/tenants: per-key limits in memory and in a real Redis server.

Each limit kind on both stores (the same cases run on each), two limiters
on one Redis (two gateway processes) admitting the limit between them, the
token reservation and its settlement, the running slot given back however
the request ends (through ``LimitScope``, as the app runs it), OpenAI's
header formats, and Redis going away and coming back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio
from prometheus_client import REGISTRY

from gateway import errors
from gateway.context import RequestContext, context_of
from gateway.tenants import limits as limits_module
from gateway.tenants.costs import choices_of, reserved
from gateway.tenants.limits import Limiter, LimitScope, settle
from gateway.tenants.redis_limits import RedisLimits, key_of
from gateway.tenants.refusals import duration, rate_headers
from gateway.tenants.windows import Decision, MemoryLimits
from shared import protocol
from shared.api_keys import KeyEntry
from tests.harness.redis_server import RedisServer

# Seconds a call may take on a busy machine before the limiter counts per
# process instead: the tests are about the limits, not about a slow Redis.
PATIENT = 30.0


# In the test's own loop, where its Redis connections are made.
@pytest_asyncio.fixture(params=["memory", "redis"], loop_scope="function")
async def limiter(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> AsyncIterator[Limiter]:
    """A limiter on each store: the same cases hold for both."""
    limiter = Limiter(redis_server.url if request.param == "redis" else "", timeout=PATIENT)
    await limiter.start()
    try:
        yield limiter
    finally:
        await limiter.stop()


def earned(per_minute: int, since: float) -> int:
    """Units a bucket of ``per_minute`` may have earned back since ``since``
    (rounded up): a busy machine between two calls shows as a few more."""
    return int((time.monotonic() - since) * per_minute / 60) + 1


def key(**limits: int) -> KeyEntry:
    """A key with ``limits``, a name and an id no other test uses (Redis outlives tests)."""
    digest = uuid.uuid4().hex * 2
    return KeyEntry(name=f"team-{digest[:8]}", key_sha256=digest, **limits)


async def take(limiter: Limiter, entry: KeyEntry, cost: int = 0) -> RequestContext:
    """One admission; the request's context (its grant and headers)."""
    context = RequestContext(key=entry)
    await limiter.admit(context, entry, lambda: (cost, 0))
    return context


async def refused(limiter: Limiter, entry: KeyEntry, cost: int = 0) -> errors.RateLimited:
    context = RequestContext(key=entry)
    with pytest.raises(errors.RateLimited) as caught:
        await limiter.admit(context, entry, lambda: (cost, 0))
    assert context.grant is None
    return caught.value


async def admitted_within(limiter: Limiter, entry: KeyEntry, seconds: float, held: str) -> None:
    """Until ``limiter`` admits one request of ``entry``; fails after ``seconds``,
    saying what still held the key's slot."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            await take(limiter, entry)
            return
        except errors.RateLimited:
            assert time.monotonic() < deadline, f"{held} still held after {seconds:g} s"
            await asyncio.sleep(0.1)


async def end(limiter: Limiter, context: RequestContext, status: int | None = 200) -> None:
    assert context.grant is not None
    context.grant.end(status)
    await limiter.drain()


# -- each limit kind, on both stores -----------------------------------------------


async def test_requests_per_minute(limiter: Limiter) -> None:
    entry = key(requests_per_minute=3)
    started = time.monotonic()
    remaining = [(await take(limiter, entry)).rate_headers for _ in range(3)]
    assert [h["x-ratelimit-remaining-requests"] for h in remaining] == ["2", "1", "0"]
    assert remaining[0]["x-ratelimit-limit-requests"] == "3"
    assert "x-ratelimit-limit-tokens" not in remaining[0]
    error = await refused(limiter, entry)
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    assert error.body()["error"]["type"] == "requests"  # as OpenAI types it
    # One request a 20 s; the first frees 20 s after it was taken.
    waited = int(time.monotonic() - started)
    assert 19 - waited <= int(error.headers()["Retry-After"]) <= 20
    assert "on requests per min (RPM): Limit 3, Used 3, Requested 1" in error.message


async def test_tokens_per_minute_and_settling(limiter: Limiter) -> None:
    entry = key(tokens_per_minute=100)
    started = time.monotonic()
    first = await take(limiter, entry, 40)
    assert first.rate_headers["x-ratelimit-remaining-tokens"] == "60"
    await take(limiter, entry, 40)
    error = await refused(limiter, entry, 40 + earned(100, started))
    assert "on tokens per min (TPM): Limit 100" in error.message
    assert error.body()["error"]["type"] == "tokens"
    # The first cost 10, not 40: 30 back, and 40 fit again.
    settle(first, protocol.Usage(4, 6))
    await end(limiter, first)
    third = await take(limiter, entry, 40)
    remaining = int(third.rate_headers["x-ratelimit-remaining-tokens"])
    assert 10 <= remaining <= 10 + earned(100, started)


async def test_a_request_over_the_whole_minute_is_refused_without_retry_after(
    limiter: Limiter,
) -> None:
    error = await refused(limiter, key(tokens_per_minute=100), 101)
    assert "Request too large" in error.message
    assert "Retry-After" not in error.headers()


async def test_max_concurrent(limiter: Limiter) -> None:
    entry = key(max_concurrent=2)
    first = await take(limiter, entry)
    await take(limiter, entry)
    error = await refused(limiter, entry)
    assert error.headers() == {"Retry-After": "1"}
    await end(limiter, first)
    await take(limiter, entry)


async def test_a_refusal_takes_nothing(limiter: Limiter) -> None:
    """Over its tokens, a request takes neither a request nor a slot."""
    entry = key(requests_per_minute=2, tokens_per_minute=100, max_concurrent=1)
    await refused(limiter, entry, 101)
    context = await take(limiter, entry, 50)
    assert context.rate_headers["x-ratelimit-remaining-requests"] == "1"


async def test_windows_free_as_time_passes(limiter: Limiter) -> None:
    """6000 a minute: 100 free within a second, not at the minute's end."""
    entry = key(tokens_per_minute=6000)
    started = time.monotonic()
    await take(limiter, entry, 6000)
    # Over what came back so far by 1000 (10 s of refill): refused however
    # slowly this process reaches the store (it may run at a small share of a core).
    await refused(limiter, entry, earned(6000, started) + 1000)
    deadline = time.monotonic() + 30  # a failure bound: 100 free within a second
    while True:
        try:
            await take(limiter, entry, 100)
            return
        except errors.RateLimited:
            assert time.monotonic() < deadline, "no request freed within 30 s"
            await asyncio.sleep(0.05)


async def test_a_key_without_limits_is_not_counted() -> None:
    context = RequestContext(key=key())
    await limits_module.admit(Limiter(), context, None, None, {}, 1)  # type: ignore[arg-type]
    assert context.grant is None and not context.rate_headers


# -- shared across processes ---------------------------------------------------------


async def test_two_limiters_on_one_redis_admit_the_limit_between_them(
    redis_server: RedisServer,
) -> None:
    first = Limiter(redis_server.url, timeout=PATIENT)
    second = Limiter(redis_server.url, timeout=PATIENT)
    entry = key(requests_per_minute=6, tokens_per_minute=1000)
    admitted = 0
    started = time.monotonic()
    try:
        for i in range(10):
            try:
                await take(first if i % 2 else second, entry, 10)
                admitted += 1
            except errors.RateLimited:
                pass
        # 6 a minute: one back every 10 s (none, unless ten calls took that long).
        assert 6 <= admitted <= 6 + int((time.monotonic() - started) // 10)
    finally:
        await first.stop()
        await second.stop()


async def test_a_killed_gateway_holds_its_slots_only_until_its_lease_lapses(
    redis_server: RedisServer,
) -> None:
    killed = Limiter(redis_server.url, timeout=PATIENT)
    other = Limiter(redis_server.url, timeout=PATIENT)
    # 5 s: the refusal below must reach Redis before the lease lapses, on a
    # machine that may give this process a small share of a core.
    killed.redis = RedisLimits(redis_server.url, lease_seconds=5.0, timeout=PATIENT)
    entry = key(max_concurrent=1)
    try:
        await take(killed, entry)  # never ended, never renewed: the process died
        await refused(other, entry)
        await admitted_within(other, entry, 30, "the dead lease")  # a failure bound
    finally:
        await killed.stop()
        await other.stop()


async def test_a_slot_an_unanswered_admission_took_is_released_once_redis_answers(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Looked at every second; the orphan is kept 3 s (room for a late look).
    monkeypatch.setattr(limits_module, "LEASE_SECONDS", 3.0)
    limiter = Limiter(redis_server.url, timeout=PATIENT)
    other = Limiter(redis_server.url, timeout=PATIENT)
    assert limiter.redis is not None
    admit = limiter.redis.admit

    async def answer_lost(*args: Any) -> Decision:
        await admit(*args)  # the script ran and took a slot...
        raise redis.exceptions.TimeoutError("answer lost")  # ...its answer never came

    monkeypatch.setattr(limiter.redis, "admit", answer_lost)
    await limiter.start()
    entry = key(max_concurrent=1)
    try:
        context = await take(limiter, entry)
        assert not context.grant.shared  # admitted by this process's own counts
        # The slot Redis holds for it (a 30 s lease) is given back within seconds.
        await admitted_within(other, entry, 20, "the orphaned slot")
    finally:
        await limiter.stop()
        await other.stop()


async def test_leases_of_running_requests_are_renewed(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Renewed every second: a renewal up to 2 s late still keeps it.
    monkeypatch.setattr(limits_module, "LEASE_SECONDS", 3.0)
    limiter = Limiter(redis_server.url, timeout=PATIENT)
    store = limiter.redis = RedisLimits(redis_server.url, lease_seconds=3.0, timeout=PATIENT)
    await limiter.start()
    entry = key(max_concurrent=1)
    conc = key_of(entry.id, "conc")
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        context = await take(limiter, entry)
        lease = context.grant.lease
        lapses = await client.zscore(conc, lease)
        # Renewed: it lapses later than it did (fails after 30 s).
        deadline = time.monotonic() + 30
        while await client.zscore(conc, lease) == lapses:
            assert time.monotonic() < deadline, "the lease was not renewed within 30 s"
            await asyncio.sleep(0.05)
        assert await store.running(entry.id) == 1
        await refused(limiter, entry)
        await end(limiter, context)
        assert await store.running(entry.id) == 0
    finally:
        await client.aclose()
        await limiter.stop()


# -- a request's end, through LimitScope -----------------------------------------------


def app_that(
    behaviour: Callable[[RequestContext, Any], Awaitable[None]],
    limiter: Limiter,
    entry: KeyEntry,
    cost: int,
) -> LimitScope:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        context = context_of(scope)
        await limiter.admit(context, entry, lambda: (cost, 0))
        await behaviour(context, send)

    return LimitScope(app)


async def _ok(context: RequestContext, send: Any) -> None:
    settle(context, protocol.Usage(3, 2))
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def _error(context: RequestContext, send: Any) -> None:
    await send({"type": "http.response.start", "status": 503, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def _crash(context: RequestContext, send: Any) -> None:
    raise RuntimeError("a bug")


async def _stream_cut(context: RequestContext, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
    raise OSError("the client went away")


async def _client_gone(context: RequestContext, send: Any) -> None:
    raise asyncio.CancelledError


# (behaviour, tokens it costs in the end, of a reservation of 50)
ENDINGS = {
    "success": (_ok, 5),
    "error": (_error, 0),
    "crash": (_crash, 0),
    "stream-cut": (_stream_cut, 50),
    "client-gone": (_client_gone, 0),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_the_slot_comes_back_and_tokens_settle_however_the_request_ends(
    limiter: Limiter, ending: str
) -> None:
    behaviour, cost = ENDINGS[ending]
    entry = key(max_concurrent=1, tokens_per_minute=1000)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    scope: dict[str, Any] = {"type": "http"}
    app = app_that(behaviour, limiter, entry, 50)
    started = time.monotonic()
    try:
        await app(scope, receive, send)
    except (RuntimeError, OSError, asyncio.CancelledError):
        pass
    await limiter.drain()
    # The slot is free again, and the window holds what the request cost.
    after = await take(limiter, entry, 1)
    remaining = int(after.rate_headers["x-ratelimit-remaining-tokens"])
    assert 1000 - cost - 1 <= remaining <= 1000 - cost + earned(1000, started)
    if sent:
        headers = dict(sent[0]["headers"])
        assert headers[b"x-ratelimit-limit-tokens"] == b"1000"
        assert headers[b"x-ratelimit-remaining-tokens"] == b"950"


async def test_an_error_refunds_but_a_client_that_left_pays_its_reservation() -> None:
    limiter = Limiter()
    entry = key(tokens_per_minute=100)
    await end(limiter, await take(limiter, entry, 60), status=503)  # never ran: given back
    left = await take(limiter, entry, 60)
    assert left.rate_headers["x-ratelimit-remaining-tokens"] == "40"
    await end(limiter, left, status=499)  # the engine may have run it: kept
    error = await refused(limiter, entry, 60)
    assert "on tokens per min (TPM)" in error.message


async def test_the_gateways_own_refusal_gives_the_request_back(limiter: Limiter) -> None:
    entry = key(requests_per_minute=2)
    # No worker for its model (503 model_not_ready), the queue full (429): not
    # the key's doing, so not one of its requests.
    await end(limiter, await take(limiter, entry), status=503)
    await end(limiter, await take(limiter, entry), status=429)
    await end(limiter, await take(limiter, entry), status=400)  # the client's own error: counted
    last = await take(limiter, entry)
    assert last.rate_headers["x-ratelimit-remaining-requests"] == "0"
    await refused(limiter, entry)


async def test_a_cache_hit_costs_no_tokens() -> None:
    limiter = Limiter()
    entry = key(tokens_per_minute=100)
    context = await take(limiter, entry, 60)
    settle(context, None)
    await end(limiter, context)
    assert (await take(limiter, entry, 100)).rate_headers["x-ratelimit-remaining-tokens"] == "0"


# -- Redis down ---------------------------------------------------------------------------


async def test_redis_down_falls_back_to_per_process_limits_and_comes_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits_module, "RETRY_SECONDS", 0.0)
    server = RedisServer(tmp_path)  # not started: Redis is down
    # Patient: a refused connection fails at once whatever the timeout, and
    # the Redis that comes back must not be taken for down on a busy machine.
    limiter = Limiter(server.url, timeout=PATIENT)
    entry = key(requests_per_minute=2)
    errors_before = _store_errors("admit")
    caplog.set_level(logging.WARNING, logger="gateway.tenants.limits")
    try:
        await take(limiter, entry)
        await take(limiter, entry)
        await refused(limiter, entry)  # still limited: in this process
        assert _store_errors("admit") - errors_before == 3
        down = [r for r in caplog.records if "does not answer" in r.message]
        assert len(down) == 1  # once, not once a request
        server.start()
        try:
            context = await take(limiter, entry)  # Redis's counts start afresh
            assert context.grant.shared
            back = [r for r in caplog.records if "answers again" in r.message]
            assert len(back) == 1
        finally:
            server.stop()
    finally:
        await limiter.stop()


def _store_errors(operation: str) -> float:
    value = REGISTRY.get_sample_value("llmgate_limits_store_errors_total", {"operation": operation})
    return value or 0.0


# -- what a request costs, and the headers --------------------------------------------


@pytest.mark.parametrize(
    ("raw", "prompt", "context", "choices", "cost"),
    [
        ({"max_tokens": 16}, 10, 2048, 1, 26),
        ({"max_completion_tokens": 16}, 10, 2048, 2, 42),
        ({"max_output_tokens": 16}, 10, 0, 1, 26),  # context not known yet
        ({"prompt": "x"}, 10, 2048, 1, 2048),  # no max_tokens: up to the context
        ({"messages": [], "n": 2}, 10, 2048, 2, 4086),
        ({"max_tokens": 5000}, 10, 2048, 1, 2048),  # it cannot generate past the context
        ({"prompt": "x"}, 10, 0, 1, 10),
        ({}, 0, 2048, 1, 0),  # GET /version: nothing to generate
    ],
)
def test_reservation(
    raw: dict[str, Any], prompt: int, context: int, choices: int, cost: int
) -> None:
    assert sum(reserved(raw, prompt, context, choices)) == cost


@pytest.mark.parametrize(
    ("raw", "choices"),
    [
        ({"messages": []}, 1),
        ({"messages": [], "n": 3}, 3),
        ({"prompt": "x", "n": 2, "best_of": 5}, 5),  # best_of sequences are generated
        ({"prompt": ["a", "b"], "n": 2}, 4),
        ({"prompt": [1, 2, 3]}, 1),  # one prompt of token ids
        ({"prompt": [[1], [2]]}, 2),
        ({"messages": [], "n": True}, 1),
        ({"messages": [[{"role": "user"}], [{"role": "user"}]], "n": 2}, 4),  # chat batch
        ({"messages": [{"role": "user"}]}, 1),
    ],
)
def test_a_reservation_counts_every_sequence_a_forwarded_request_may_generate(
    raw: dict[str, Any], choices: int
) -> None:
    assert choices_of(raw) == choices


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.02, "20ms"),
        (0.9994, "1s"),
        (1, "1s"),
        (1.5, "1.5s"),
        (59.999, "59.999s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (361.25, "6m1.25s"),
        (3723, "1h2m3s"),
    ],
)
def test_durations_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_headers_name_only_the_limits_a_key_has() -> None:
    decision = Decision(
        allowed=True,
        remaining_requests=5,
        reset_requests=10,
        remaining_tokens=100,
        reset_tokens=0.3,
    )
    assert rate_headers(key(requests_per_minute=6, tokens_per_minute=200), decision) == {
        "x-ratelimit-limit-requests": "6",
        "x-ratelimit-remaining-requests": "5",
        "x-ratelimit-reset-requests": "10s",
        "x-ratelimit-limit-tokens": "200",
        "x-ratelimit-remaining-tokens": "100",
        "x-ratelimit-reset-tokens": "300ms",
    }
    assert rate_headers(key(max_concurrent=3), decision) == {}


def test_memory_windows_with_a_clock() -> None:
    """GCRA's arithmetic, with time in the test's hand."""
    now = [1000.0]
    store = MemoryLimits(clock=lambda: now[0])
    entry = key(requests_per_minute=2)
    assert store.admit(entry, 0).allowed
    assert store.admit(entry, 0).allowed
    third = store.admit(entry, 0)
    assert not third.allowed and third.retry_after == pytest.approx(30)
    assert third.reset_requests == pytest.approx(60)
    now[0] += 30
    fourth = store.admit(entry, 0)
    assert fourth.allowed and fourth.remaining_requests == 0
    now[0] += 60
    assert store.admit(entry, 0).remaining_requests == 1
