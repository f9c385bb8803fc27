"""gateway/workers.py's monitor: a worker is lost for its silence, and only for its own.

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

import pytest

from gateway.workers import Workers, WorkerState
from shared import protocol
from shared.settings import GatewaySettings
from tests.gateway import test_pool as pool_tests


class Link(pool_tests.Link):
    """test_pool's link, plus ``waiting``: what the monitor reads, one per tick."""

    def read_ready(self) -> None:
        if self.waiting:  # one message arrived per tick
            self.waiting.pop(0)()


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
        GatewaySettings(heartbeat_interval=1.0, heartbeat_timeout=3.0),
        "gw",
        on_message=lambda link, message: None,
        on_lost=lambda worker, reason: None,
        on_up=lambda: None,
    )
    yield pool
    pool.ctx.term()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    simulated = Clock()
    # The modules themselves (gateway.workers uses time.monotonic, asyncio.sleep).
    monkeypatch.setattr(time, "monotonic", simulated.monotonic)
    monkeypatch.setattr(asyncio, "sleep", simulated.sleep)
    return simulated


def run_monitor(workers: Workers, clock: Clock, steps: list[float]) -> None:
    """Run the monitor for one tick per step, the clock moving by each."""
    clock.steps = iter(steps)
    with pytest.raises(Stop):
        asyncio.run(workers.monitor())


def worker(workers: Workers) -> tuple[WorkerState, Callable[[], None]]:
    link = Link(address="tcp://a:5550", sent=[], waiting=[], last_received=0.0)
    state = WorkerState(link=link)  # type: ignore[arg-type]
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


def test_a_late_tick_judges_no_one(workers: Workers, clock: Clock) -> None:
    # The gateway itself was paused for 10 s: nothing it could read yet says
    # the worker lives, but its silence is the gateway's own.
    state, beat = worker(workers)
    beat()
    run_monitor(workers, clock, [10.0])
    assert state.healthy
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
