"""gateway/dispatch/fair_share.py through admission: which waiting request a freed slot goes to.

One worker with one slot, as the tests of gateway/dispatch/admission.py build it; each
request asks for the slot as a key (a tenant), and the test ends the running
request, with its usage, to free the slot. The order in which requests got
the slot is the outcome asserted.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from gateway.api.call import Call
from gateway.context import context_of
from gateway.dialects import schemas, sse
from gateway.dispatch.admission import Admission
from gateway.dispatch.fair_share import DEFAULT_ESTIMATE, FairShare, Tenant
from gateway.dispatch.pool import Pool
from gateway.dispatch.work import WorkOrder
from gateway.dispatch.workers import Worker, Workers
from shared import protocol, routes
from shared.api_keys import KeyEntry
from shared.settings import GatewaySettings, LinkSettings, RoutingSettings
from tests.gateway.api.test_attempts import answer, generated, sent_to
from tests.gateway.test_admission import M, add, admission
from tests.gateway.test_liveness import NoEvents
from tests.gateway.test_pool import healthy_worker

TIER = M.tiers[0]


@pytest.fixture
def workers() -> Iterator[Workers]:
    known = Workers(LinkSettings(startup_timeout=0.01), "gw", events=NoEvents())
    yield known
    known.ctx.term()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class OneSlot:
    """A gateway with one slot: requests by key, queued in the order sent."""

    def __init__(self, gate: Admission, worker: Worker) -> None:
        self.gate = gate
        self.worker = worker
        # Labels in the order their requests got the slot.
        self.served: list[str] = []
        self.running: collections.deque[Tenant] = collections.deque()
        self.tasks: list[asyncio.Task[None]] = []
        self.sent: collections.Counter[Tenant] = collections.Counter()

    async def _one(self, tenant: Tenant, label: str, low: bool) -> None:
        order = WorkOrder(
            label, "completion", M, {}, band=protocol.BATCH if low else 0, tenant=tenant
        )
        worker, _ = await self.gate.acquire(order)
        worker.in_flight += 1
        self.served.append(label)
        self.running.append(tenant)

    async def send(self, tenant: Tenant, count: int = 1, low: bool = False) -> None:
        """``count`` requests of ``tenant``, each asking for the slot in turn."""
        for _ in range(count):
            label = f"{tenant}{self.sent[tenant]}"
            self.sent[tenant] += 1
            task = asyncio.create_task(self._one(tenant, label, low))
            self.tasks.append(task)
            await settle()

    async def end(self, tokens: int | None = 100) -> None:
        """The running request ends with ``tokens`` of usage; the slot goes to the next."""
        tenant = self.running.popleft()
        self.worker.in_flight -= 1
        self.gate.finished(TIER, 1.0, tenant, tokens)
        await settle()

    async def drain(self, tokens: int | None = 100) -> None:
        while self.running:
            await self.end(tokens)

    def first(self, count: int) -> list[str]:
        return self.served[:count]


def one_slot(workers: Workers, **settings: Any) -> OneSlot:
    gate = admission(workers, **settings)
    return OneSlot(gate, add(workers, "a", capacity=1))


async def test_one_request_of_a_quiet_key_is_served_before_most_of_a_flood_queued_ahead(
    workers: Workers,
) -> None:
    bench = one_slot(workers)
    await bench.send("a", 20)  # one runs, 19 wait
    await bench.send("b")
    await bench.drain()
    assert len(bench.served) == 21
    assert bench.served.index("b0") == 1  # right after the one that was running


async def test_without_fair_sharing_the_quiet_key_waits_behind_the_whole_flood(
    workers: Workers,
) -> None:
    bench = one_slot(workers, fair_share=False)
    await bench.send("a", 20)
    await bench.send("b")
    await bench.drain()
    assert bench.served[-1] == "b0"


async def test_two_flooding_keys_share_the_slot_by_turns(workers: Workers) -> None:
    bench = one_slot(workers)
    await bench.send("a", 6)
    await bench.send("b", 6)
    await bench.drain(tokens=int(DEFAULT_ESTIMATE))  # as expected: no estimate to correct
    keys = [label[0] for label in bench.served]
    # a's first ran at once; then b (less served), and from then on by turns.
    assert keys == ["a"] + ["b", "a"] * 5 + ["b"]


async def test_shares_are_weighed_in_tokens_not_requests(workers: Workers) -> None:
    bench = one_slot(workers)
    await bench.send("big", 10)
    await bench.send("small", 10)
    # big's requests cost 1000 tokens each, small's 100: small gets the slot more often.
    for _ in range(12):
        tokens = 1000 if bench.running[0] == "big" else 100
        await bench.end(tokens)
    keys = [label.rstrip("0123456789") for label in bench.served[:12]]
    assert keys.count("small") >= 8


async def test_a_key_idle_for_a_while_gets_no_burst_when_it_comes_back(workers: Workers) -> None:
    bench = one_slot(workers)
    await bench.send("b")
    await bench.end()  # b was served once, long ago
    await bench.send("a", 30)  # a alone: its counter climbs far above b's
    for _ in range(24):
        await bench.end()
    await bench.send("b", 6)  # b is back, behind a's last six
    await bench.drain()
    after = [label.rstrip("0123456789") for label in bench.served[26:]]
    # Lifted to a's counter: b's requests take turns with a's, not all at once.
    assert after[:6].count("b") <= 3
    assert after[:6].count("a") >= 3


async def test_requests_without_a_key_are_served_first_come_first_served(
    workers: Workers,
) -> None:
    bench = one_slot(workers)
    for _ in range(5):
        await bench.send(None)
    # Whatever their usage, one line: in order.
    for tokens in (5000, 1, 800, 3):
        await bench.end(tokens)
    await bench.drain()
    assert bench.served == [f"None{i}" for i in range(5)]


async def test_a_batch_key_waits_behind_every_interactive_request(workers: Workers) -> None:
    bench = one_slot(workers)
    await bench.send("i")
    await bench.send("batch", 3, low=True)  # first in line, and the least served
    await bench.send("i", 2)
    await bench.drain()
    assert [label.rstrip("0123456789") for label in bench.served] == ["i"] * 3 + ["batch"] * 3


async def test_a_woken_request_that_leaves_without_the_slot_is_not_charged(
    workers: Workers,
) -> None:
    bench = one_slot(workers)
    await bench.send("a")
    await bench.send("b")
    before = bench.gate.fair.counter("b")
    waiting = bench.tasks[-1]
    # b is woken for the slot and leaves (its client gone) before it takes it.
    bench.worker.in_flight -= 1
    bench.gate.finished(TIER, 1.0, bench.running.popleft(), 100)
    waiting.cancel()
    await settle()
    assert bench.gate.fair.counter("b") == before


# -- the counters ----------------------------------------------------------------


def test_a_request_is_charged_its_expected_cost_and_then_its_usage() -> None:
    share = FairShare()
    share.arrive("a")
    share.charge("a")
    assert share.counter("a") == DEFAULT_ESTIMATE
    share.finished("a", 40)
    assert share.counter("a") == 40
    share.arrive("a")
    share.charge("a")  # the estimate has moved toward a's usage
    assert 40 < share.counter("a") < 40 + DEFAULT_ESTIMATE
    share.finished("a", None)  # aborted: the estimate stands
    assert share.counter("a") > 40


def test_a_newly_active_key_starts_at_the_least_served_active_key() -> None:
    share = FairShare()
    for tenant, tokens in (("a", 500), ("b", 900)):
        share.arrive(tenant)
        share.charge(tenant)
        share.finished(tenant, tokens)
        share.arrive(tenant)  # active again, with a request running
    share.arrive("c")
    assert share.counter("c") == 500


def test_a_key_arriving_when_none_is_active_starts_where_the_last_left_off() -> None:
    share = FairShare()
    share.arrive("a")
    share.charge("a")
    share.finished("a", 700)
    share.arrive("b")
    assert share.counter("b") == 700


# -- keys to admission (gateway/api/call.py, gateway/dispatch/pool.py) -------------------


def _call(pool: Pool, key: KeyEntry | None) -> Call:
    services = SimpleNamespace(
        pool=pool, settings=GatewaySettings(), cache=None, limits=None, ledger=None
    )
    app = SimpleNamespace(services=services)
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": routes.COMPLETIONS.path,
        "headers": [],
        "app": app,
    }
    context_of(scope).key = key

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError

    raw = {"model": "m", "prompt": "Hi"}
    body = schemas.validate(raw, schemas.CompletionRequest)
    builder = sse.Completion("", "m", 1, None)
    return Call(Request(scope, receive), "completion", routes.COMPLETIONS.path, raw, body, builder)


async def test_a_request_goes_to_admission_as_its_key_and_a_batch_key_at_low_priority() -> None:
    pool = Pool()
    try:
        interactive = KeyEntry(name="team-a", key_sha256="0" * 64)
        batch = KeyEntry(name="nightly", key_sha256="1" * 64, band="batch")
        first = _call(pool, interactive)._attempts(None)
        # Shared fairly by the key's id: a name added again is another key.
        assert (first.tenant, first.band) == (interactive.id, protocol.INTERACTIVE)
        second = _call(pool, batch)._attempts(None)
        assert (second.tenant, second.band) == (batch.id, protocol.BATCH)
        keyless = _call(pool, None)._attempts(None)
        assert (keyless.tenant, keyless.band) == (None, protocol.INTERACTIVE)
    finally:
        pool.workers.ctx.term()


async def test_the_pool_charges_a_request_its_usage_as_the_worker_reports_it() -> None:
    pool = Pool(routing=RoutingSettings(policy="round-robin"))
    try:
        worker = healthy_worker(pool, "a")
        handle = await pool.submit(WorkOrder("r", "completion", "m", {}, 0.0, tenant="team-a"))
        rid = await sent_to(worker)
        answer(pool, worker, rid, "Hello", " world")
        async for _ in handle:
            pass
        handle.close()
        # answer() reports 3 prompt tokens and one completion token per text.
        assert pool.admission.fair.counter("team-a") == 3 + 2
    finally:
        pool.workers.ctx.term()


async def test_a_request_carries_its_keys_rank_to_the_engine_once_the_counters_are_shared() -> None:
    """The engine's queue holds every gateway's requests: a request's vLLM
    priority is its band and, once the counters are every process's
    (gateway.tenants.fair_counters), its key's counter before its charge;
    until then first come, first served within the band."""
    pool = Pool(routing=RoutingSettings(policy="round-robin"))
    try:
        worker = healthy_worker(pool, "a")

        async def one(rid: str) -> int:
            handle = await pool.submit(WorkOrder(rid, "completion", "m", {}, 0.0, tenant="team-a"))
            sent = await generated(worker)
            answer(pool, worker, sent.request_id, "Hello", " world")  # 5 tokens
            async for _ in handle:
                pass
            handle.close()
            return sent.priority

        assert await one("r1") == protocol.engine_priority(protocol.INTERACTIVE, 0)
        pool.admission.fair.absorb({}, None, 0.0)  # an exchange answered: shared
        assert await one("r2") == protocol.engine_priority(protocol.INTERACTIVE, 5)
        assert await one("r3") == protocol.engine_priority(protocol.INTERACTIVE, 10)
    finally:
        pool.workers.ctx.term()
