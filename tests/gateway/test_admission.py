"""gateway/dispatch/admission.py on its own: free slots, the queue and its bounds, refusals.

Pools and tiers (spill-over) are in test_tiers.py, low priority in
tests/gateway/batch/test_priority.py; here one pool, as without a config.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from gateway import errors
from gateway.dispatch.admission import Admission
from gateway.dispatch.models import Target, Tier
from gateway.dispatch.policies.round_robin import RoundRobin
from gateway.dispatch.work import WorkOrder
from gateway.dispatch.workers import Worker, Workers
from shared import protocol
from shared.settings import AdmissionSettings, LinkSettings
from tests.gateway.test_liveness import NoEvents
from tests.gateway.test_pool import Link

M = Target("m", (Tier("", "m"),))


@pytest.fixture
def workers() -> Iterator[Workers]:
    known = Workers(LinkSettings(startup_timeout=0.01), "gw", events=NoEvents())
    yield known
    known.ctx.term()


def admission(workers: Workers, **settings: Any) -> Admission:
    merged = {"queue_timeout": 30.0, **settings}
    return Admission(AdmissionSettings(**merged), workers, RoundRobin())


def add(workers: Workers, name: str, capacity: int, model: str = "m") -> Worker:
    state = Worker(link=Link(address=f"tcp://{name}:5550", sent=[]))  # type: ignore[arg-type]
    workers.by_address[state.address] = state
    workers.on_heartbeat(state, protocol.Heartbeat(name, "i", [model], capacity=capacity))
    return state


async def take(gate: Admission, exclude: tuple[str, ...] = ()) -> Worker:
    """Admit one request for ``m`` and occupy its slot, as the pool does."""
    chosen, tier = await gate.acquire(WorkOrder("r", "completion", M, {}), exclude)
    assert tier.model == "m"
    chosen.in_flight += 1
    return chosen


def leave(gate: Admission, worker: Worker) -> None:
    """A request on ``worker`` ends, as the pool's release tells admission."""
    worker.in_flight -= 1
    gate.finished(Tier("", "m"), 1.0)


async def test_a_request_takes_a_free_slot_at_once(workers: Workers) -> None:
    gate = admission(workers)
    a = add(workers, "a", capacity=2)
    assert await take(gate) is a
    assert await take(gate) is a
    assert gate.queued == 0


async def test_with_every_slot_taken_a_request_waits_for_the_next_one_to_free(
    workers: Workers,
) -> None:
    gate = admission(workers)
    a = add(workers, "a", capacity=1)
    await take(gate)
    waiting = asyncio.create_task(take(gate))
    await asyncio.sleep(0.01)
    assert not waiting.done() and gate.queued == 1
    leave(gate, a)
    assert await waiting is a
    assert gate.queued == 0


async def test_a_full_queue_is_a_429_with_retry_after(workers: Workers) -> None:
    gate = admission(workers, max_queue=1)
    add(workers, "a", capacity=1)
    await take(gate)
    waiting = asyncio.create_task(take(gate))
    await asyncio.sleep(0.01)
    with pytest.raises(errors.Overloaded) as refused:
        await take(gate)
    assert refused.value.status == 429 and refused.value.headers() == {"Retry-After": "1"}
    waiting.cancel()


async def test_a_request_that_waits_past_the_queue_timeout_is_a_429(workers: Workers) -> None:
    gate = admission(workers, queue_timeout=0.05)
    add(workers, "a", capacity=1)
    await take(gate)
    with pytest.raises(errors.Overloaded, match="Timed out waiting"):
        await take(gate)
    assert gate.queued == 0


async def test_a_slot_is_the_smaller_of_what_the_worker_says_and_the_flag(
    workers: Workers,
) -> None:
    gate = admission(workers, max_inflight_per_worker=1, queue_timeout=0.01)
    add(workers, "a", capacity=8)
    add(workers, "b", capacity=8)
    assert gate.capacity() == 2
    taken = {(await take(gate)).address, (await take(gate)).address}
    assert taken == {"tcp://a:5550", "tcp://b:5550"}
    with pytest.raises(errors.Overloaded):  # both hold one: full
        await take(gate)


async def test_excluded_workers_are_skipped_and_none_left_is_a_503(workers: Workers) -> None:
    gate = admission(workers)
    add(workers, "a", capacity=4)
    b = add(workers, "b", capacity=4)
    assert await take(gate, exclude=("tcp://a:5550",)) is b
    with pytest.raises(errors.NoWorker, match="No other worker"):
        await take(gate, exclude=("tcp://a:5550", "tcp://b:5550"))


async def test_no_healthy_worker_is_a_503_after_the_startup_wait(workers: Workers) -> None:
    with pytest.raises(errors.NoWorker) as refused:
        await take(admission(workers))
    assert refused.value.status == 503


async def test_a_model_nobody_serves_is_a_404(workers: Workers) -> None:
    gate = admission(workers)
    add(workers, "a", capacity=4, model="other")
    with pytest.raises(errors.ModelNotFound):
        await take(gate)


async def test_a_draining_worker_takes_nothing_new(workers: Workers) -> None:
    gate = admission(workers)
    a = add(workers, "a", capacity=4)
    workers.on_heartbeat(a, protocol.Heartbeat("a", "i", ["m"], capacity=4, draining=True))
    assert not gate.serves(Tier("", "m"))
    with pytest.raises(errors.NoWorker):
        await take(gate)


async def test_a_worker_coming_up_wakes_as_many_queued_requests_as_it_has_slots(
    workers: Workers,
) -> None:
    gate = admission(workers)
    add(workers, "a", capacity=1)
    await take(gate)
    queued = [asyncio.create_task(take(gate)) for _ in range(3)]
    await asyncio.sleep(0.01)
    b = add(workers, "b", capacity=2)
    gate.wake()  # what the pool does when a worker comes up
    done, pending = await asyncio.wait(queued, timeout=0.2, return_when=asyncio.ALL_COMPLETED)
    assert [task.result() for task in done] == [b, b]
    assert len(pending) == 1
    for task in pending:
        task.cancel()


async def test_a_freed_slot_a_queued_retry_may_not_use_goes_to_the_next_in_line(
    workers: Workers,
) -> None:
    """A retry must not go back to the worker it failed on: a slot freeing there
    wakes the request behind it instead of leaving the slot idle."""
    gate = admission(workers)
    a = add(workers, "a", capacity=1)
    add(workers, "b", capacity=1)
    await take(gate)
    await take(gate)  # both full
    retry = asyncio.create_task(take(gate, exclude=(a.address,)))
    await asyncio.sleep(0.01)
    behind = asyncio.create_task(take(gate))
    await asyncio.sleep(0.01)
    assert gate.queued == 2
    leave(gate, a)  # a frees: the retry, first in line, may not use it
    assert await asyncio.wait_for(behind, 5) is a
    assert not retry.done() and gate.queued == 1
    retry.cancel()


async def test_a_freed_slot_goes_to_the_highest_band_waiting(workers: Workers) -> None:
    """Whatever order they came in: interactive, then standard, then batch."""
    gate = admission(workers)
    a = add(workers, "a", capacity=1)
    await take(gate)
    served: list[str] = []

    async def wait_in(band: int) -> None:
        order = WorkOrder(protocol.BANDS[band], "completion", M, {}, band=band)
        chosen, _ = await gate.acquire(order)
        chosen.in_flight += 1
        served.append(order.request_id)

    tasks = []
    for band in (protocol.BATCH, protocol.STANDARD, protocol.INTERACTIVE):
        tasks.append(asyncio.create_task(wait_in(band)))
        for _ in range(100):  # until it waits in its line (no other task runs)
            await asyncio.sleep(0)
    assert gate.queued == 2 and not served  # the batch line waits apart
    for expected in ("interactive", "standard", "batch"):
        leave(gate, a)
        for _ in range(100):
            if len(served) == protocol.BANDS.index(expected) + 1:
                break
            await asyncio.sleep(0)
        assert served[-1] == expected
    await asyncio.gather(*tasks)
