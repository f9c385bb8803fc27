"""Batch lines on spare capacity only: admission's low priority (gateway/dispatch/admission.py),
the wire priority (Generate.priority), the worker's mapping and its default policy."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.dispatch.pool import Pool
from gateway.dispatch.work import WorkOrder
from gateway.dispatch.workers import Worker
from shared import protocol
from shared.settings import BatchSettings, GatewaySettings
from worker import main as worker_main
from worker.engine import Engine

MODEL = "m"


class Link(SimpleNamespace):
    def send(self, message: Any) -> None:
        self.sent.append(message)


def make_pool(capacity: int, **settings: Any) -> tuple[Pool, Worker]:
    given = GatewaySettings.of(**settings)
    pool = Pool(given.link, given.admission, given.routing)
    state = Worker(link=Link(address="tcp://w:5550", sent=[]))  # type: ignore[arg-type]
    pool.workers.by_address[state.address] = state
    pool.workers.on_heartbeat(state, protocol.Heartbeat("w", "i", [MODEL], capacity=capacity))
    return pool, state


async def submit(pool: Pool, rid: str, low: bool = False) -> Any:
    return await pool.submit(
        WorkOrder(rid, "chat", MODEL, {}, 0.0, band=protocol.BATCH if low else 0)
    )


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_batch_line_takes_a_free_slot_and_carries_the_batch_priority() -> None:
    pool, worker = make_pool(capacity=2)
    handle = await submit(pool, "b", low=True)
    interactive = await submit(pool, "i")
    sent = worker.link.sent  # type: ignore[attr-defined]
    assert [m.priority for m in sent] == [protocol.engine_priority(protocol.BATCH_PRIORITY), 0]
    handle.close()
    interactive.close()
    pool.workers.ctx.term()


async def test_a_freed_slot_goes_to_the_interactive_request_even_if_the_batch_line_came_first() -> (
    None
):
    pool, _ = make_pool(capacity=1)
    busy = await submit(pool, "busy")
    line = asyncio.create_task(submit(pool, "line", low=True))
    await settle()
    interactive = asyncio.create_task(submit(pool, "interactive"))
    await settle()
    assert not line.done() and not interactive.done()
    busy.close()
    first = await interactive
    await settle()
    assert not line.done()  # still waiting: the slot went to the interactive request
    first.close()
    (await line).close()
    pool.workers.ctx.term()


async def test_a_batch_line_never_takes_a_slot_an_interactive_request_waits_for() -> None:
    pool, _ = make_pool(capacity=2)
    a, b = await submit(pool, "a"), await submit(pool, "b")
    queued = asyncio.create_task(submit(pool, "queued"))
    await settle()
    a.close()  # one slot frees, and the queued interactive request is woken for it
    line = asyncio.create_task(submit(pool, "line", low=True))
    await settle()
    assert queued.done() and not line.done()
    b.close()
    (await line).close()
    queued.result().close()
    pool.workers.ctx.term()


async def test_waiting_batch_lines_never_fill_the_interactive_queue() -> None:
    pool, _ = make_pool(capacity=1, max_queue=1)
    busy = await submit(pool, "busy")
    lines = [asyncio.create_task(submit(pool, f"line{i}", low=True)) for i in range(3)]
    await settle()
    # The queue holds one request, and the three batch lines do not count.
    interactive = asyncio.create_task(submit(pool, "interactive"))
    await settle()
    assert pool.admission.queued == 1 and not interactive.done()
    busy.close()
    (await interactive).close()
    for line in lines:
        (await line).close()
    pool.workers.ctx.term()


@pytest.mark.parametrize(("policy", "engine_priority"), [("priority", protocol.BATCH), ("fcfs", 0)])
def test_the_worker_applies_the_priority_only_under_the_priority_policy(
    policy: str, engine_priority: int
) -> None:
    engine = Engine.__new__(Engine)  # no AsyncLLM: only the mapping
    engine.scheduling_policy = policy
    assert engine.engine_priority(protocol.BATCH_PRIORITY) == engine_priority
    assert engine.engine_priority(0) == 0


def test_workers_run_the_priority_policy_unless_told_otherwise() -> None:
    parser = worker_main.build_parser()
    assert parser.parse_args([]).scheduling_policy == "priority"
    assert parser.parse_args(["--scheduling-policy", "fcfs"]).scheduling_policy == "fcfs"


def test_an_old_gateways_generate_decodes_with_priority_zero() -> None:
    """Appending the field kept the wire compatible (no PROTOCOL_VERSION bump)."""
    old = protocol.encoder().encode(["gen", "r", MODEL, "chat", {}, 0.0, None])
    message = protocol.worker_decoder().decode(old)
    assert isinstance(message, protocol.Generate) and message.priority == 0


async def test_the_pool_knows_when_interactive_requests_were_last_about() -> None:
    pool, _ = make_pool(capacity=4)
    line = await submit(pool, "line", low=True)
    # None yet: infinitely long ago, however recently this machine booted
    # (a CI machine up for 225 s once read as 'an interactive request 225 s ago').
    assert pool.interactive_in_flight == 0 and pool.interactive_since() == math.inf
    interactive = await submit(pool, "interactive")
    assert pool.interactive_since() == 0.0
    interactive.close()
    line.close()
    assert pool.interactive_in_flight == 0 and pool.interactive_since() < 1.0
    pool.workers.ctx.term()


@pytest.mark.parametrize(
    ("max_inflight", "since", "cap"), [(0, 0.0, 2), (0, 60.0, 128), (3, 0.0, 3), (3, 60.0, 3)]
)
def test_the_runner_takes_few_slots_while_interactive_requests_come_in(
    max_inflight: int, since: float, cap: int
) -> None:
    from gateway.batch.runner import Runner

    settings = BatchSettings(batch_max_inflight=max_inflight)
    runner = Runner(None, None, lambda: 256, lambda: since, settings)  # type: ignore[arg-type]
    assert runner.cap() == cap
