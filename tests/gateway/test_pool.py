"""gateway/dispatch/pool.py: what arrives for a request reaches its handle, and only its own.

Regression tests for the review of the request lifecycle: a retry used to
reuse its request id, so a lost worker that came back could push its late
tokens into the retry's stream.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway import errors
from gateway.dispatch.handle import WorkerLost
from gateway.dispatch.pool import Pool
from gateway.dispatch.work import WorkOrder
from gateway.dispatch.workers import Worker
from shared import protocol
from shared.settings import RoutingSettings


class Link(SimpleNamespace):
    """A worker link that keeps what it is asked to send."""

    def send(self, message: Any) -> None:
        self.sent.append(message)


def healthy_worker(pool: Pool, name: str) -> Worker:
    worker = Worker(link=Link(address=f"tcp://{name}:5550", sent=[]))  # type: ignore[arg-type]
    pool.workers.by_address[worker.address] = worker
    beat = protocol.Heartbeat(name, "incarnation", ["m"], capacity=8)
    pool.workers.on_heartbeat(worker, beat)
    return worker


@pytest.fixture
async def pool() -> Any:
    running = Pool(routing=RoutingSettings(policy="round-robin"))
    yield running
    running.workers.ctx.term()


def delta(request_id: str, text: str, usage: bool = False) -> protocol.Deltas:
    return protocol.Deltas(
        items=[
            protocol.Delta(request_id, 0, text, 1, usage=protocol.Usage(1, 1) if usage else None)
        ]
    )


async def test_a_retry_never_receives_what_the_lost_worker_sends_late(pool: Pool) -> None:
    a, b = healthy_worker(pool, "a"), healthy_worker(pool, "b")
    first = await pool.submit(WorkOrder("req-1", "completion", "m", {}, 0.0), exclude=[b.address])
    assert first.answered_by.address == a.address and first.request_id == "req-1"
    pool.workers.lose(a, "silent for 3.1s")
    assert isinstance(await first.next(), WorkerLost)
    first.close()
    retry = await pool.submit(WorkOrder("req-1", "completion", "m", {}, 0.0), exclude=[a.address])
    assert retry.answered_by.address == b.address
    assert retry.request_id != "req-1"  # its own id on the wire
    # The hung worker comes back and sends what it had for req-1: dropped.
    pool.worker_output(a.link, delta("req-1", " stale", usage=True))
    pool.worker_output(a.link, delta(retry.request_id, " wrong link"))
    pool.worker_output(b.link, delta(retry.request_id, " fresh"))
    item = retry.next_nowait()
    assert isinstance(item, protocol.Delta) and item.text == " fresh"
    assert retry.next_nowait() is None and not retry.finished
    retry.close()


async def test_a_lost_worker_is_told_to_abort_our_requests(pool: Pool) -> None:
    a = healthy_worker(pool, "a")
    handle = await pool.submit(WorkOrder("req-2", "completion", "m", {}, 0.0))
    pool.workers.lose(a, "silent for 3.1s")
    aborts = [m for m in a.link.sent if isinstance(m, protocol.Abort)]  # type: ignore[attr-defined]
    assert aborts and aborts[-1].request_ids == ["req-2"]
    handle.close()


async def test_closing_an_old_handle_twice_leaves_the_new_one_alone(pool: Pool) -> None:
    a = healthy_worker(pool, "a")
    old = await pool.submit(WorkOrder("req-3", "completion", "m", {}, 0.0))
    old.close()
    new = await pool.submit(WorkOrder("req-3", "completion", "m", {}, 0.0))
    old.close()
    assert list(pool.pending) == [new.request_id]
    assert a.in_flight == 1
    new.close()
    assert a.in_flight == 0 and not pool.pending


async def test_two_requests_with_one_client_id_get_two_wire_ids(pool: Pool) -> None:
    healthy_worker(pool, "a")
    first = await pool.submit(WorkOrder("same", "completion", "m", {}, 0.0))
    second = await pool.submit(WorkOrder("same", "completion", "m", {}, 0.0))
    assert first.request_id == "same" and second.request_id.startswith("same~")
    first.close()
    second.close()


async def test_a_request_past_its_deadline_times_out_and_one_before_it_runs_on(
    pool: Pool,
) -> None:
    healthy_worker(pool, "a")
    soon = await pool.submit(WorkOrder("soon", "completion", "m", {}, deadline=1000.0))
    later = await pool.submit(WorkOrder("later", "completion", "m", {}, deadline=2000.0))
    never = await pool.submit(WorkOrder("never", "completion", "m", {}, deadline=0.0))
    pool.expire_overdue(now=1500.0)
    with pytest.raises(errors.Timeout):
        soon.next_nowait()  # the deadline is no item...
        await asyncio.wait_for(soon.next(), 60)  # ...but ends the wait (60: a guard)
    for handle in (later, never):
        assert handle.next_nowait() is None and not handle.finished
        link = pool.workers.by_address[handle.answered_by.address].link
        pool.worker_output(link, delta(handle.request_id, " on", usage=True))
        item = await handle.next()
        assert isinstance(item, protocol.Delta) and item.text == " on"
    for handle in (soon, later, never):
        handle.close()
