"""A periodic loop's lateness, on simulated clocks: wall time and this process's CPU."""

from __future__ import annotations

import time

import pytest

from shared.ticks import Ticks


class Clocks:
    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 5.0

    def advance(self, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu


@pytest.fixture
def clocks(monkeypatch: pytest.MonkeyPatch) -> Clocks:
    simulated = Clocks()
    monkeypatch.setattr(time, "monotonic", lambda: simulated.wall)
    monkeypatch.setattr(time, "process_time", lambda: simulated.cpu)
    return simulated


def test_a_tick_on_time_or_a_little_late_is_judged(
    clocks: Clocks, caplog: pytest.LogCaptureFixture
) -> None:
    ticks = Ticks(1.0, "gateway", "workers' silence")
    for wall in (1.0, 1.5, 2.9, 3.0):  # up to interval + 1 s late
        clocks.advance(wall, 0.01)
        assert not ticks.late()
    assert caplog.text == ""


def test_a_stopped_process_is_told_from_a_blocked_loop(
    clocks: Clocks, caplog: pytest.LogCaptureFixture
) -> None:
    ticks = Ticks(1.0, "gateway", "workers' silence")
    clocks.advance(11.0, 0.2)  # stopped or starved: hardly any CPU of its own
    assert ticks.late()
    assert (
        "this gateway's event loop woke 10.0s late (the process was paused or starved of CPU: "
        "0.2s of CPU used meanwhile): workers' silence is judged on a later tick"
    ) in caplog.text
    caplog.clear()
    clocks.advance(1.0, 0.0)
    assert not ticks.late()  # measured from the late tick, not the one before
    clocks.advance(6.0, 5.8)  # its own work held the loop
    assert ticks.late()
    assert "woke 5.0s late (work in this process held its event loop: 5.8s" in caplog.text
