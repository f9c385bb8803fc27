"""The stall watch that failed tests report (tests/stall_watch.py) sees this process stopped."""

from __future__ import annotations

import os
import subprocess
import time

from tests.stall_watch import LATE, StallWatch, report


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
