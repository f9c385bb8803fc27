"""Fair sharing's counters across gateway processes: two processes' ``FairShare`` kept level
through a real Redis (``gateway.tenants.fair_counters``), each exchange driven by the test."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest_asyncio

from gateway.dispatch.fair_share import FairShare
from gateway.tenants.fair_counters import FairCounters
from gateway.tenants.limits import Limiter
from shared import protocol
from tests.harness.redis_server import RedisServer

PATIENT = 30.0  # seconds a test waits for Redis (the machine may be busy)


@dataclass
class Process:
    share: FairShare
    counters: FairCounters


@pytest_asyncio.fixture(loop_scope="function")
async def processes(redis_server: RedisServer) -> AsyncIterator[tuple[Process, Process]]:
    """Two gateway processes' counters in one Redis, under a prefix of their own;
    the test runs their exchanges (no background task)."""
    prefix = f"test:fair:{uuid.uuid4().hex}:{{fair}}:"
    made = []
    limiters = []
    for _ in "ab":
        limiter = Limiter(redis_server.url, timeout=PATIENT)
        limiters.append(limiter)
        share = FairShare()
        assert limiter.redis is not None
        made.append(Process(share, FairCounters(share, limiter, limiter.redis.client, prefix)))
    try:
        yield made[0], made[1]
    finally:
        for limiter in limiters:
            await limiter.stop()


def serve(share: FairShare, tenant: str, tokens: int) -> None:
    """A request of ``tenant`` given its slot and ended with ``tokens`` of usage."""
    share.arrive(tenant)
    share.charge(tenant)
    share.finished(tenant, tokens)


async def test_service_in_one_process_counts_in_the_other(
    processes: tuple[Process, Process],
) -> None:
    a, b = processes
    a.share.arrive("flood")  # one of its requests stays in flight in a
    for _ in range(3):
        serve(a.share, "flood", 1000)
    await a.counters.exchange()
    b.share.arrive("flood")
    await b.counters.exchange()
    assert b.share.counter("flood") == a.share.counter("flood") == 3000
    serve(b.share, "flood", 500)
    await b.counters.exchange()
    await a.counters.exchange()
    assert a.share.counter("flood") == b.share.counter("flood") == 3500


async def test_a_key_becoming_active_in_one_process_starts_level_with_those_active_in_another(
    processes: tuple[Process, Process],
) -> None:
    """No banked credit across processes: a key new to ``b`` starts at the
    least-served key active anywhere, not at nothing."""
    a, b = processes
    a.share.arrive("flood")
    serve(a.share, "flood", 4000)
    await a.counters.exchange()
    await b.counters.exchange()
    b.share.arrive("trickle")
    assert b.share.counter("trickle") == 4000
    # And the lift reaches a: its own newcomer starts there too.
    await b.counters.exchange()
    await a.counters.exchange()
    a.share.arrive("trickle")
    assert a.share.counter("trickle") == 4000


async def test_ranks_in_the_engines_queue_come_from_the_shared_counters(
    processes: tuple[Process, Process],
) -> None:
    """A request's rank is its key's counter before its charge, once the counters
    are shared: the flood's requests queued from ``a`` rank behind the trickle's
    from ``b``; before any exchange, every rank is 0 (first come, first served)."""
    a, b = processes
    a.share.arrive("flood")
    a.share.charge("flood")
    assert a.share.rank("flood") == 0  # not shared yet
    a.share.finished("flood", 3000)
    ranks = []
    for _ in range(3):  # queued in the engine, each charged when sent
        a.share.arrive("flood")
        a.share.charge("flood")
        ranks.append(a.share.rank("flood"))
    assert ranks == [0, 0, 0]
    await a.counters.exchange()
    await b.counters.exchange()
    a.share.arrive("flood")
    a.share.charge("flood")
    flood_rank = a.share.rank("flood")
    b.share.arrive("trickle")
    b.share.charge("trickle")
    trickle_rank = b.share.rank("trickle")
    assert trickle_rank == 3000 < flood_rank
    assert protocol.engine_priority(protocol.INTERACTIVE, trickle_rank) < (
        protocol.engine_priority(protocol.INTERACTIVE, flood_rank)
    )
    # A band still comes before any rank.
    assert protocol.engine_priority(protocol.INTERACTIVE, flood_rank) < (
        protocol.engine_priority(protocol.STANDARD, 0)
    )


async def test_a_key_no_process_holds_active_stops_setting_where_newcomers_start(
    redis_server: RedisServer, processes: tuple[Process, Process]
) -> None:
    a, b = processes
    a.counters.active_seconds = 0.2
    a.share.arrive("flood")
    serve(a.share, "flood", 2000)
    await a.counters.exchange()
    a.share.depart("flood")  # idle now: a stops saying it is active

    # Until the key's activity lapses in Redis (its clock; a bound guards a hang).
    async with asyncio.timeout(PATIENT):
        await b.counters.exchange()
        while b.share.active_min is not None:
            await asyncio.sleep(0.05)
            await b.counters.exchange()
    # The floor keeps what the least-served active key had reached: a newcomer
    # starts there (idle time banks no credit), not below.
    b.share.arrive("newcomer")
    assert b.share.counter("newcomer") == 2000


async def test_what_redis_did_not_hear_is_told_when_it_answers(
    redis_server: RedisServer, processes: tuple[Process, Process]
) -> None:
    """Service settled while Redis was down is not lost: the next exchange that
    reaches it carries it, once."""
    a, b = processes
    a.share.arrive("flood")
    serve(a.share, "flood", 1000)
    told = a.share.exchange()  # taken for an exchange that fails
    a.share.untold(told)
    serve(a.share, "flood", 500)
    await a.counters.exchange()
    b.share.arrive("flood")
    await b.counters.exchange()
    assert b.share.counter("flood") == 1500
