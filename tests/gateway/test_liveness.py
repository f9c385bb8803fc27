"""gateway/dispatch/workers.py's monitor: a worker is lost for its silence, and only for its own;
a silent worker's streams under way, and its requests no other worker could
take, wait for it up to --stall-timeout.

The CI run of 2026-11-25 failed in the hung-worker test with every request
on the other worker; one way there is a gateway that judges a worker silent
while that worker's heartbeats wait unread (the gateway starved of CPU, or
its timers run before its I/O in a loop turn). The clock and the monitor's
sleep are simulated here: each tick moves the clock by what the test says.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from prometheus_client import REGISTRY

from gateway.dispatch.handle import RequestHandle, WorkerLost
from gateway.dispatch.policies import make_policy
from gateway.dispatch.pool import Pool
from gateway.dispatch.work import WorkOrder
from gateway.dispatch.workers import Worker, Workers
from loadtest.sim_engine import described_tokenizer
from shared import protocol
from shared.settings import LinkSettings
from tests.gateway import test_pool as pool_tests


class Link(pool_tests.Link):
    """test_pool's link, plus ``waiting``: what the monitor reads, one per tick."""

    def read_ready(self) -> None:
        if self.waiting:  # one message arrived per tick
            self.waiting.pop(0)()


class NoEvents:
    """WorkerEvents that do nothing: the monitor alone is under test."""

    def worker_output(self, link: Any, message: Any) -> None:
        pass

    def worker_lost(self, worker: Worker, reason: str, may_return: bool) -> tuple[list[str], int]:
        return [], 0

    def worker_up(self) -> None:
        pass

    def worker_draining(self, worker: Any) -> None:
        pass


class Stop(Exception):
    pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.steps: Iterator[float] = iter(())

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        try:
            self.now += next(self.steps)
        except StopIteration:
            raise Stop from None


@pytest.fixture
def workers() -> Iterator[Workers]:
    pool = Workers(
        LinkSettings(heartbeat_interval=1.0, heartbeat_timeout=3.0), "gw", events=NoEvents()
    )
    yield pool
    pool.ctx.term()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    simulated = Clock()
    # The modules themselves (gateway.dispatch.workers uses time.monotonic, asyncio.sleep).
    monkeypatch.setattr(time, "monotonic", simulated.monotonic)
    monkeypatch.setattr(asyncio, "sleep", simulated.sleep)
    return simulated


def run_monitor(workers: Workers, clock: Clock, steps: list[float]) -> None:
    """Run the monitor for one tick per step, the clock moving by each."""
    clock.steps = iter(steps)
    with pytest.raises(Stop):
        asyncio.run(workers.monitor())


def worker(workers: Workers) -> tuple[Worker, Callable[[], None]]:
    link = Link(address="tcp://a:5550", sent=[], waiting=[], last_received=0.0)
    state = Worker(link=link)  # type: ignore[arg-type]
    workers.by_address[state.address] = state

    def beat() -> None:
        workers.on_heartbeat(state, protocol.Heartbeat("a", "one", ["m"], capacity=8))

    return state, beat


def test_a_worker_silent_past_the_timeout_is_lost(workers: Workers, clock: Clock) -> None:
    state, beat = worker(workers)
    beat()
    run_monitor(workers, clock, [1.0] * 3)
    assert state.healthy  # 3 s: not past the timeout yet
    run_monitor(workers, clock, [1.0])
    assert not state.healthy


def test_heartbeats_waiting_unread_are_read_before_judging(workers: Workers, clock: Clock) -> None:
    state, beat = worker(workers)
    beat()
    # Its heartbeats arrived but wait in the socket: the monitor reads them first.
    state.link.waiting.extend([beat] * 6)  # type: ignore[attr-defined]
    run_monitor(workers, clock, [1.0] * 6)
    assert state.healthy


def test_a_late_tick_judges_no_one(
    workers: Workers, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # The gateway itself was paused for 10 s: nothing it could read yet says
    # the worker lives, but its silence is the gateway's own.
    state, beat = worker(workers)
    beat()
    run_monitor(workers, clock, [10.0])
    assert state.healthy
    assert "this gateway's event loop woke 9.0s late" in caplog.text
    # Once on time again, a worker still silent is lost.
    run_monitor(workers, clock, [1.0])
    assert not state.healthy


def test_a_worker_sending_output_lives_though_its_heartbeat_is_late(
    workers: Workers, clock: Clock
) -> None:
    state, beat = worker(workers)
    beat()

    def output() -> None:
        state.link.last_received = clock.now

    state.link.waiting.extend([output] * 6)  # type: ignore[attr-defined]
    run_monitor(workers, clock, [1.0] * 6)
    assert state.healthy
    run_monitor(workers, clock, [1.0] * 4)  # and then nothing more: lost
    assert not state.healthy


# -- a stalled worker's streams (--stall-timeout) ------------------------------


async def tick(workers: Workers, clock: Clock, steps: list[float]) -> None:
    """The monitor, one tick per step, inside a running loop (the pool's handles need one)."""
    clock.steps = iter(steps)
    with pytest.raises(Stop):
        await workers.monitor()


def add_worker(pool: Pool, name: str) -> tuple[Worker, Callable[[], None]]:
    link = Link(address=f"tcp://{name}:5550", sent=[], waiting=[], last_received=0.0)
    state = Worker(link=link)  # type: ignore[arg-type]
    pool.workers.by_address[state.address] = state

    def beat() -> None:
        pool.workers.on_heartbeat(state, protocol.Heartbeat(name, "one", ["m"], capacity=8))

    beat()
    return state, beat


async def stalled_pool(
    settings: LinkSettings, another_worker: bool = True
) -> tuple[Pool, Worker, RequestHandle, RequestHandle, Callable[[], None]]:
    """A pool with a worker running two requests for us: a stream whose first
    token went out to its client, and a request that sent nothing yet; and
    (``another_worker``) a second worker, whose heartbeats keep coming."""
    pool = Pool(settings)
    state, beat = add_worker(pool, "a")
    stream = await pool.submit(WorkOrder("stream", "completion", "m", {}, 0.0))
    stream.mark_streaming()  # as gateway.api.attempts marks it once the stream starts
    waiting = await pool.submit(WorkOrder("waiting", "completion", "m", {}, 0.0))
    if another_worker:
        other, other_beat = add_worker(pool, "b")
        other.link.waiting.extend([other_beat] * 100)  # type: ignore[attr-defined]
    return pool, state, stream, waiting, beat


def close(pool: Pool, *handles: RequestHandle) -> None:
    for handle in handles:
        handle.close()
    pool.workers.ctx.term()


def aborted(state: Worker) -> list[str]:
    sent = state.link.sent  # type: ignore[attr-defined]
    return [rid for m in sent if isinstance(m, protocol.Abort) for rid in m.request_ids]


def stalls(outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "llmgate_worker_stalls_total", {"worker": "tcp://a:5550", "outcome": outcome}
    )
    return value or 0.0


def settings(stall_timeout: float = 30.0) -> LinkSettings:
    return LinkSettings(heartbeat_interval=1.0, heartbeat_timeout=3.0, stall_timeout=stall_timeout)


def test_a_stalled_worker_keeps_its_streams_and_they_carry_on(clock: Clock) -> None:
    async def run() -> None:
        pool, state, stream, waiting, beat = await stalled_pool(settings())
        resumed = stalls("resumed")
        await tick(pool.workers, clock, [1.0] * 4)  # silent past --heartbeat-timeout
        assert not state.healthy and state.stalled
        # What sent nothing to its client yet goes elsewhere, and is aborted there...
        assert isinstance(waiting.next_nowait(), WorkerLost)
        assert aborted(state) == ["waiting"]
        # ...the stream waits for it.
        assert stream.next_nowait() is None and not stream.finished
        await tick(pool.workers, clock, [1.0] * 20)  # 24 s of silence: still waiting
        assert stream.next_nowait() is None
        beat()  # it speaks again
        assert state.healthy and not state.stalled
        assert stalls("resumed") == resumed + 1
        pool.worker_output(state.link, pool_tests.delta("stream", " on", usage=True))
        item = stream.next_nowait()
        assert isinstance(item, protocol.Delta) and item.text == " on"
        await tick(pool.workers, clock, [1.0])
        assert aborted(state) == ["waiting"]  # and nothing more
        close(pool, stream, waiting)

    asyncio.run(run())


def test_a_stalled_worker_silent_past_the_stall_timeout_ends_its_streams(clock: Clock) -> None:
    async def run() -> None:
        pool, state, stream, waiting, _ = await stalled_pool(settings())
        lost_before = stalls("lost")
        await tick(pool.workers, clock, [1.0] * 29)
        assert stream.next_nowait() is None
        await tick(pool.workers, clock, [1.0] * 2)  # 31 s of silence
        lost = stream.next_nowait()
        assert isinstance(lost, WorkerLost) and "silent for 31" in lost.reason
        assert aborted(state) == ["waiting", "stream"]
        assert not state.stalled
        assert stalls("lost") == lost_before + 1
        close(pool, stream, waiting)

    asyncio.run(run())


def test_a_stalled_workers_dropped_connection_ends_its_streams_at_once(clock: Clock) -> None:
    async def run() -> None:
        pool, state, stream, waiting, _ = await stalled_pool(settings())
        await tick(pool.workers, clock, [1.0] * 4)
        assert state.stalled
        pool.workers._on_disconnect(state.link)  # type: ignore[arg-type]
        assert isinstance(stream.next_nowait(), WorkerLost)
        assert not state.stalled
        close(pool, stream, waiting)

    asyncio.run(run())


def test_a_stall_timeout_within_the_heartbeat_timeout_ends_streams_with_the_loss(
    clock: Clock,
) -> None:
    async def run() -> None:
        pool, state, stream, waiting, _ = await stalled_pool(settings(stall_timeout=0))
        await tick(pool.workers, clock, [1.0] * 4)
        assert isinstance(stream.next_nowait(), WorkerLost)
        assert isinstance(waiting.next_nowait(), WorkerLost)
        assert not state.stalled
        close(pool, stream, waiting)

    asyncio.run(run())


def test_a_client_leaving_a_waiting_stream_aborts_it_on_the_stalled_worker(
    clock: Clock,
) -> None:
    async def run() -> None:
        pool, state, stream, waiting, _ = await stalled_pool(settings())
        await tick(pool.workers, clock, [1.0] * 4)
        waiting.close()
        stream.close()  # the client went away: the worker drops it once it reads this
        assert aborted(state) == ["waiting", "stream"]
        pool.workers.ctx.term()

    asyncio.run(run())


# -- with no other worker, every request waits ----------------------------------


def test_with_no_other_worker_a_stalled_workers_requests_all_wait_and_carry_on(
    clock: Clock,
) -> None:
    # One worker (the CPU default): a retry of the request that sent nothing
    # yet could only be a 503, so it waits for the worker with the stream.
    async def run() -> None:
        pool, state, stream, waiting, beat = await stalled_pool(settings(), another_worker=False)
        resumed = stalls("resumed")
        await tick(pool.workers, clock, [1.0] * 4)
        assert not state.healthy and state.stalled
        assert waiting.next_nowait() is None and stream.next_nowait() is None
        assert aborted(state) == []
        await tick(pool.workers, clock, [1.0] * 20)
        beat()
        assert state.healthy and stalls("resumed") == resumed + 1
        pool.worker_output(state.link, pool_tests.delta("waiting", " done", usage=True))
        item = waiting.next_nowait()
        assert isinstance(item, protocol.Delta) and item.text == " done"
        assert aborted(state) == []
        close(pool, stream, waiting)

    asyncio.run(run())


def test_with_no_other_worker_a_stall_past_the_timeout_fails_every_request(
    clock: Clock,
) -> None:
    async def run() -> None:
        pool, state, stream, waiting, _ = await stalled_pool(settings(), another_worker=False)
        await tick(pool.workers, clock, [1.0] * 31)
        assert isinstance(waiting.next_nowait(), WorkerLost)
        assert isinstance(stream.next_nowait(), WorkerLost)
        assert sorted(aborted(state)) == ["stream", "waiting"]
        assert not state.stalled
        close(pool, stream, waiting)

    asyncio.run(run())


def test_only_a_kv_gateway_asks_the_workers_for_their_tokenizer(workers: Workers) -> None:
    state, _ = worker(workers)
    # It publishes KV events (no block size: nothing to subscribe to here).
    beat = protocol.Heartbeat("a", "one", ["m"], capacity=8, kv_events_port=5557)
    workers.on_heartbeat(state, beat)
    assert not [m for m in state.link.sent if isinstance(m, protocol.Describe)]
    make_policy("kv", 1.25, 2, workers)
    workers.on_heartbeat(state, beat)
    assert [m.model for m in state.link.sent if isinstance(m, protocol.Describe)] == ["m"]


def test_a_heartbeat_says_how_many_gateways_share_the_worker(workers: Workers) -> None:
    state, _ = worker(workers)
    workers.on_heartbeat(state, protocol.Heartbeat("a", "one", ["m"], gateways=8))
    assert state.gateways == 8
    # A worker of before the count (0): this gateway alone, as far as it knows.
    workers.on_heartbeat(state, protocol.Heartbeat("a", "one", ["m"]))
    assert state.gateways == 1


def test_an_adapter_shares_its_base_models_tokenizer_and_is_keyed_apart(
    workers: Workers,
) -> None:
    base = described_tokenizer()
    adapter = msgspec.structs.replace(base, model="m-lora", lora="m-lora")
    workers._tokenizer("tcp://10.0.0.1:5550", base)
    workers._tokenizer("tcp://10.0.0.1:5550", adapter)
    # One tokenizer loaded for both (an adapter pool may serve dozens).
    assert workers.tokenizers["m-lora"] is workers.tokenizers[base.model]
    assert workers.adapters == {"m-lora": "m-lora"}
