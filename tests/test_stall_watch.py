"""The stall watch that failed tests report (tests/stall_watch.py) sees this process stopped."""

from __future__ import annotations

import os
import subprocess
import time
from datetime import datetime
from pathlib import Path

from tests.stall_watch import LATE, StallWatch, report, stall_reports, warnings_logged


def test_a_stopped_process_is_reported_as_a_stall() -> None:
    watch = StallWatch()
    start = time.time()
    # Another process stops this one (SIGSTOP) for 4 s, then lets it go on.
    stopper = subprocess.Popen(
        ["sh", "-c", f"sleep 0.5; kill -STOP {os.getpid()}; sleep 4; kill -CONT {os.getpid()}"]
    )
    stopper.wait()
    time.sleep(1.5)  # the watch's next wake-up, after the stop
    stalls = watch.between(start, time.time())
    assert any(4 - LATE < stall.seconds < 60 for stall in stalls), stalls
    text = report(watch, start, time.time())
    assert "s late; load" in text and "busiest processes" in text, text


def test_the_kernels_stall_reports_during_the_test_are_picked_out() -> None:
    # As the CI's virtual machine logged it (12:43:46 UTC), with lines around it.
    dmesg = (
        "2026-11-26T12:43:40,100000+00:00 hrtimer: interrupt took 1081102 ns\n"
        "2026-11-26T12:43:46,672836+00:00 BUG: workqueue lockup - pool cpus=0 node=0 "
        "flags=0x0 nice=0 stuck for 34s!\n"
        "2026-11-26T12:43:46,672900+00:00 Showing busy workqueues and worker pools:\n"
        "2026-11-26T13:00:00,000000+00:00 BUG: workqueue lockup - pool cpus=1 stuck for 31s!\n"
    )
    at = datetime.fromisoformat("2026-11-26T12:43:46+00:00").timestamp()
    found = stall_reports(dmesg, at - 60, at + 60)
    assert len(found) == 1 and "cpus=0" in found[0] and "stuck for 34s" in found[0], found
    assert stall_reports(dmesg, at + 60, at + 120) == []


def test_the_warnings_the_systems_logged_during_the_test_are_picked_out(tmp_path: Path) -> None:
    now = time.time()

    def stamp(at: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + ",250"

    gateway = tmp_path / "t0" / "gateway.log"
    gateway.parent.mkdir()
    gateway.write_text(
        f"{stamp(now - 600)} WARNING MainProcess[1] llmgate.gateway.workers: before the test\n"
        f"{stamp(now)} INFO MainProcess[1] llmgate.gateway.workers: worker up\n"
        f"{stamp(now)} WARNING MainProcess[1] llmgate.gateway.workers: worker x lost: silent\n"
        "(EngineCore pid=7) WARNING 11-27 02:29:59 [cpu.py:224] vLLM's own warning\n"
    )
    # Another system's log, read after it, with an earlier warning: one timeline.
    worker = tmp_path / "t0" / "worker.log"
    worker.write_text(f"{stamp(now - 2)} ERROR MainProcess[2] worker.server: first\n")
    found = warnings_logged([gateway, tmp_path / "missing.log", worker], now - 5, now + 5)
    assert found == [
        f"t0/worker.log: {stamp(now - 2)} ERROR MainProcess[2] worker.server: first",
        f"t0/gateway.log: {stamp(now)} WARNING MainProcess[1] llmgate.gateway.workers: "
        "worker x lost: silent",
    ], found
    watch = StallWatch()
    assert "worker x lost: silent" in report(watch, now - 5, now + 5, [gateway])
