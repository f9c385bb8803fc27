"""The stall watch that failed tests report (harness/stall_watch.py) sees this process stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from tests.harness.cpu_heartbeats import INTERVAL, CpuHeartbeats
from tests.harness.stall_watch import (
    LATE,
    LoopWatch,
    Stall,
    StallWatch,
    memory_between,
    memory_counters,
    report,
    stall_reports,
    warnings_logged,
    watched_policy,
)
from tests.harness.waiting import wait_until


def recorded(watch: StallWatch, start: float, wanted: Callable[[Stall], bool]) -> list[Stall]:
    """The stalls since ``start`` that ``wanted`` picks, once there is one: the
    watch's thread records a stall at its next wake-up, which a process given
    a small share of a core may get late (fails after 30 s)."""

    def picked() -> list[Stall]:
        return [s for s in watch.between(start, time.time()) if wanted(s)]

    wait_until(picked, "the watch's record of the stall", timeout=30)
    return picked()


def test_a_stopped_process_is_reported_as_a_stall() -> None:
    watch = StallWatch()
    start = time.time()
    # Another process stops this one (SIGSTOP) for 4 s, then lets it go on.
    stopper = subprocess.Popen(
        ["sh", "-c", f"sleep 0.5; kill -STOP {os.getpid()}; sleep 4; kill -CONT {os.getpid()}"]
    )
    stopper.wait()
    stalls = recorded(watch, start, lambda s: 4 - LATE < s.seconds < 60)
    # Stopped, it used no CPU: told apart from a thread that held the GIL.
    assert stalls[0].cpu < 1.0, stalls
    assert "test_a_stopped_process_is_reported_as_a_stall" in stalls[0].test
    assert "GiB available; meanwhile" in stalls[0].memory, stalls
    text = report(watch, start, time.time())
    assert "of CPU used by this process meanwhile" in text and "busiest processes" in text, text


# How long the held-GIL test may hold before it fails instead (seconds of
# wall time; it needs 1.5 s of CPU, so a share of a core under 2%).
HOLD_GUARD = 120


def test_a_thread_holding_the_gil_is_a_stall_with_the_cpu_it_used() -> None:
    """The main thread keeps the GIL (a switch interval longer than its work,
    as a long C call or the garbage collector would): the watch's thread is
    late, and the stall carries the CPU the process used meanwhile.

    The hold ends on the process's own CPU clock, not the wall's: on a
    machine whose cores are all taken (a busy-core run: stress-ng beside the
    integration session, this session at nice 10) the process gets a small
    share of a core, once 0.94 s of CPU in 8 s. So it holds until it has used
    1.5 s of CPU and 4 s have passed (over LATE: the watch is late), however
    long that takes; whatever share it gets, the stall must carry the CPU it
    used (a stopped process's carries none: the test above)."""
    watch = StallWatch()
    start = time.time()
    interval = sys.getswitchinterval()
    # Longer than any hold, so the watch's thread waits for the whole of it
    # and one stall spans it.
    sys.setswitchinterval(HOLD_GUARD + 60)
    try:
        cpu_start = time.process_time()
        wall_start = time.perf_counter()
        while time.process_time() - cpu_start < 1.5 or time.perf_counter() - wall_start < 4:
            # Not hung on a machine that gives the process almost nothing.
            assert time.perf_counter() - wall_start < HOLD_GUARD, time.process_time() - cpu_start
        used = time.process_time() - cpu_start
    finally:
        sys.setswitchinterval(interval)
    held_until = time.time()
    stalls = recorded(watch, start, lambda s: s.seconds > LATE and s.ended >= held_until)
    assert stalls[0].cpu >= 0.9 * used, (used, stalls)
    assert "test_stall_watch.py" in stalls[0].main_thread, stalls


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


def test_an_event_loop_held_past_its_bound_gets_every_threads_stack_dumped() -> None:
    """A coroutine that blocks its loop (a synchronous sleep here) shows in the
    report with the stack that held it, the CPU used meanwhile and each core's
    heartbeat."""
    cores = CpuHeartbeats()
    watch = StallWatch(cores)
    loops = LoopWatch(watch, after=2.0)
    runner = asyncio.Runner(loop_factory=watched_policy(loops).new_event_loop)

    async def blocks_its_loop() -> None:
        await asyncio.sleep(0.1)
        time.sleep(4)  # noqa: ASYNC251 - the blocking call the watch must catch

    start = time.time()
    with runner:
        runner.run(blocks_its_loop())
    # faulthandler's thread writes the dump, the watch's thread reads it; in a
    # process given a small share of a core either may come late, and the
    # main thread (where the loop was held) is the last one dumped.
    wait_until(
        lambda: any("blocks_its_loop" in s.stacks for s in loops.between(start, time.time())),
        "the dump with the held loop's stack",
        timeout=30,
    )
    text = report(watch, start, time.time(), loops=loops)
    assert "stalls of the test's event loop during the test: \n" in text, text
    assert "blocks_its_loop" in text
    assert "cores' heartbeats: core" in text
    cores.stop()


def test_a_dump_read_while_it_was_written_is_one_stall_whole() -> None:
    """faulthandler writes a dump in many small writes; a watch that reads the
    file between two of them (a starved process) gets the rest at its next
    read, and keeps it as the same stall, in order."""
    loops = LoopWatch(StallWatch(), after=60.0)
    head = 'Timeout (0:00:20)!\nThread 0x1 (most recent call first):\n  File "a.py", li'
    tail = 'ne 1 in held\n\nThread 0x2 (most recent call first):\n  File "b.py", line 2\n'
    os.write(loops.dump.fileno(), head.encode())
    wait_until(lambda: loops.stalls, "the first half read", timeout=30)
    os.write(loops.dump.fileno(), tail.encode())
    wait_until(lambda: "b.py" in loops.stalls[-1].stacks, "the second half read", timeout=30)
    os.write(loops.dump.fileno(), (head + tail).encode())
    wait_until(lambda: len(loops.stalls) == 2, "the next dump read", timeout=30)
    assert [s.stacks for s in loops.stalls] == [head + tail, head + tail], loops.stalls


def test_a_loop_that_stopped_running_is_not_a_stall() -> None:
    watch = StallWatch()
    loops = LoopWatch(watch, after=1.0)
    start = time.time()
    with asyncio.Runner(loop_factory=watched_policy(loops).new_event_loop) as runner:
        runner.run(asyncio.sleep(0.1))
        time.sleep(3)  # the loop is not running now: its silence is no stall
    assert loops.between(start, time.time()) == []


def test_a_core_that_ran_nothing_is_named_by_its_heartbeat() -> None:
    """Stopping the heartbeat pinned to a core stands for that core running
    nothing (a virtual CPU its host did not run): its next wake-up is late by
    the stop, and a stall over that time names the core."""
    cores = CpuHeartbeats()
    try:
        core = cores.cores[-1]
        deadline = time.monotonic() + 60
        while not cores.running():
            assert time.monotonic() < deadline, "the heartbeats did not start"
            time.sleep(0.1)
        start = time.time()
        beat = cores.processes[core]
        os.kill(beat.pid, signal.SIGSTOP)
        time.sleep(3)
        os.kill(beat.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while not [b for b in cores.late_beats() if b.core == core]:
            assert time.monotonic() < deadline, "the stopped heartbeat wrote no late wake-up"
            time.sleep(0.1)
        [late] = [b for b in cores.late_beats() if b.core == core]
        assert late.seconds > 3 - INTERVAL, late
        assert f"core {core} {late.seconds:.1f} s late" in cores.during(start, time.time())
    finally:
        cores.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a process's priority takes root")
def test_a_main_thread_that_no_core_takes_is_a_stall_spent_queued() -> None:
    """The main thread, holding the GIL, is pinned to one core that a process of
    the highest priority spins on for 3 s: runnable all along, it is hardly
    given the core, and the stall is the time it waited for one, with almost
    no CPU used (a stopped process waits for none: the first test)."""
    watch = StallWatch()
    core = sorted(os.sched_getaffinity(0))[-1]
    spin = (
        "import time\nend = time.monotonic() + 3\nprint(flush=True)\n"
        "while time.monotonic() < end: pass"
    )
    affinity = os.sched_getaffinity(0)
    interval = sys.getswitchinterval()
    spinner = subprocess.Popen(
        ["nice", "-n", "-20", "taskset", "-c", str(core), sys.executable, "-c", spin],
        stdout=subprocess.PIPE,
    )
    try:
        assert spinner.stdout is not None
        spinner.stdout.readline()  # it spins from now on
        start = time.time()
        os.sched_setaffinity(0, {core})  # this thread only
        sys.setswitchinterval(10)
        # Held until after the spinner's end, without a call that lets the GIL go.
        end = time.monotonic() + 3
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(interval)
        os.sched_setaffinity(0, affinity)
        spinner.wait(timeout=60)
    stalls = recorded(watch, start, lambda s: s.seconds > LATE)
    assert stalls[0].waited > 0.8 * stalls[0].seconds, stalls
    assert stalls[0].cpu < 0.5 * stalls[0].seconds, stalls


def test_a_stalls_memory_line_counts_what_the_kernel_did_to_find_memory() -> None:
    before = memory_counters()
    after = {name: count + 3 for name, count in before.items()}
    after["allocstall"] += 2
    text = memory_between(before, after)
    assert "5 direct reclaims, 3 compaction stalls, 3 major faults" in text, text
