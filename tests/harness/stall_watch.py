"""What the machine did while a test failed: stalls of the test process, load, busiest processes.

CI runs have failed in ways no local run reproduced, whose logs show the
test process acting minutes later than the system it tested. A daemon thread
here wakes every half second; a wake-up far later than asked means this
process (or the whole machine) did not run meanwhile. A failed test's report
gets a section listing the stalls during it, the machine's load then, and
the processes that used the most CPU just after it failed, each core's
heartbeat over each stall (tests/harness/cpu_heartbeats.py), and what the
kernel logged meanwhile of a CPU that made no progress: on the CI's virtual
machine it once reported one stuck for 34 s (its host did not run that
virtual CPU), and a process queued there gets no CPU at all meanwhile while
the rest of the machine runs on. A stall of another process (a gateway, a
worker) shows in what that process logged: the warnings and errors the
systems under test logged during the test are listed too (a late tick of
their event loop, a worker lost, a gateway given up on).

A test's own event loop is watched too (:class:`LoopWatch`): every loop the
suite creates (``asyncio.run``, pytest-asyncio's) ticks once a second, and a
tick re-arms ``faulthandler``'s timer. A loop that has not ticked for
``LOOP_STALL`` seconds while it runs gets every thread's stack dumped (by
faulthandler's own C thread, so a thread holding the GIL cannot stop it),
with the CPU each process of the system under test used meanwhile, into the
failed test's report: a test that acts minutes late shows where it was.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from tests.harness.cpu_heartbeats import CpuHeartbeats

# Bound at import: tests that monkeypatch ``time.monotonic`` with a simulated
# clock (tests/shared/test_ticks.py, test_liveness.py, the cache's) must not
# be read here as the process stalling for hours when the real clock returns.
_MONOTONIC = time.monotonic
INTERVAL = 0.5
# Seconds later than asked that count as a stall.
LATE = 2.0
# Seconds a running event loop of the test may go without a tick before its
# threads' stacks are dumped.
LOOP_STALL = 20.0
# The header faulthandler writes before each timed dump: "Timeout (0:00:20)!".
DUMP_START = re.compile(r"^(?=Timeout \()", re.MULTILINE)
# How often the CPU of this process and its descendants is sampled, and how
# many samples are kept (the CPU used over a stall is read from them).
CPU_SAMPLE_EVERY = 5.0
CPU_SAMPLES_KEPT = 120


@dataclass(frozen=True)
class Stall:
    ended: float  # wall clock
    seconds: float
    load: str
    # CPU seconds this process used over the stall: about the stall's length
    # means one of its threads ran holding the GIL (a long C call, the garbage
    # collector); about 0 that the process did not run (stopped, or no core).
    cpu: float = 0.0
    # The test running then (pytest's PYTEST_CURRENT_TEST) and where the main
    # thread was when this thread ran again.
    test: str = ""
    main_thread: str = ""
    # Seconds of the stall the main thread spent queued for a core
    # (/proc's schedstat run delay): about all of it means it could run and no
    # core took it; about 0 with no CPU used, that it was stopped or asleep.
    waited: float = 0.0
    # What the kernel did for memory meanwhile (``memory_between``): direct
    # reclaim and compaction run in the task that allocates, on its core.
    memory: str = ""

    def __str__(self) -> str:
        clock = time.strftime("%H:%M:%S", time.gmtime(self.ended))
        text = (
            f"{clock} UTC: {self.seconds:.1f} s late, {self.cpu:.1f} s of CPU used by "
            f"this process meanwhile, its main thread queued for a core {self.waited:.1f} s "
            f"of it; {self.load}"
        )
        if self.test:
            text += f"\n    during {self.test}"
        if self.main_thread:
            text += f"\n    the main thread then: {self.main_thread}"
        if self.memory:
            text += f"\n    memory: {self.memory}"
        return text


def main_thread_at() -> str:
    """The innermost frames of the main thread now, innermost last."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return ""
    return " <- ".join(
        f"{Path(f.filename).name}:{f.lineno} {f.name}"
        for f in reversed(traceback.extract_stack(frame)[-4:])
    )


def run_delay(thread_id: int | None) -> float:
    """Seconds a thread of this process has spent runnable and waiting for a core."""
    try:
        return int(Path(f"/proc/self/task/{thread_id}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


# /proc/vmstat's counters of a kernel busy finding memory (summed by prefix).
MEMORY_COUNTERS = {
    "allocstall": "direct reclaims",
    "compact_stall": "compaction stalls",
    "pgmajfault": "major faults",
    "pswpin": "pages swapped in",
}


def memory_counters() -> dict[str, int]:
    counts = dict.fromkeys(MEMORY_COUNTERS, 0)
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            name, value = line.split()
            for prefix in MEMORY_COUNTERS:
                if name.startswith(prefix):
                    counts[prefix] += int(value)
    except (OSError, ValueError):
        pass
    return counts


def memory_between(before: dict[str, int], after: dict[str, int]) -> str:
    """The memory the machine had at the end, and what it took the kernel to find it."""
    available = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    counts = ", ".join(
        f"{after[name] - before.get(name, 0)} {label}" for name, label in MEMORY_COUNTERS.items()
    )
    return f"{available} available; meanwhile {counts}"


def machine_load() -> str:
    """Load averages and the CPU pressure (share of time some task waited for a core)."""
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        pressure = some.split()[1]  # avg10=...
    except (OSError, IndexError):
        pressure = "avg10=?"
    return f"load {load}, CPU pressure {pressure}"


@dataclass(frozen=True)
class CpuSample:
    at: float  # wall clock
    # pid -> (command line, CPU seconds so far) for this process and its descendants.
    processes: dict[int, tuple[str, float]]
    # The machine's CPU seconds by kind (/proc/stat: user, system, idle, iowait, steal).
    machine: dict[str, float]


def cpu_sample() -> CpuSample:
    processes: dict[int, tuple[str, float]] = {}
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            command = " ".join(proc.cmdline())[:100] or proc.name()
            processes[proc.pid] = (command, times.user + times.system)
        except psutil.Error:
            pass
    machine: dict[str, float] = {}
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        tick = os.sysconf("SC_CLK_TCK")
        for name, index in (("user", 0), ("system", 2), ("idle", 3), ("iowait", 4), ("steal", 7)):
            machine[name] = int(fields[index]) / tick
    except (OSError, IndexError, ValueError):
        pass
    return CpuSample(time.time(), processes, machine)


def cpu_used(before: CpuSample, after: CpuSample, top: int = 10) -> str:
    """What each process (and the machine) spent between two samples."""
    seconds = after.at - before.at
    used = []
    for pid, (command, cpu) in after.processes.items():
        was = before.processes.get(pid, (command, 0.0))[1]
        used.append((cpu - was, pid, command))
    used.sort(reverse=True)
    machine = ", ".join(
        f"{name} {after.machine[name] - before.machine.get(name, 0.0):.1f}s"
        for name in after.machine
    )
    lines = [f"CPU over {seconds:.0f}s, machine: {machine or '?'}"]
    lines += [f"{cpu:7.1f}s {pid} {command}" for cpu, pid, command in used[:top]]
    return "\n    ".join(lines)


class StallWatch:
    def __init__(self, cores: CpuHeartbeats | None = None) -> None:
        """``cores``: each core's heartbeat, told with each stall (cpu_heartbeats.py)."""
        self.cores = cores
        self._stalls: list[Stall] = []
        self.samples: deque[CpuSample] = deque(maxlen=CPU_SAMPLES_KEPT)
        threading.Thread(target=self._run, name="stall-watch", daemon=True).start()

    def _run(self) -> None:
        last = _MONOTONIC()
        last_cpu = time.process_time()
        main = threading.main_thread().native_id
        last_delay = run_delay(main)
        last_memory = memory_counters()
        sampled = -CPU_SAMPLE_EVERY
        while True:
            time.sleep(INTERVAL)
            now, cpu, delay = _MONOTONIC(), time.process_time(), run_delay(main)
            memory = memory_counters()
            late = now - last - INTERVAL
            used, waited = cpu - last_cpu, delay - last_delay
            since, last_memory = last_memory, memory
            last, last_cpu, last_delay = now, cpu, delay
            if late > LATE:
                test = os.environ.get("PYTEST_CURRENT_TEST", "")
                stall = Stall(
                    ended=time.time(),
                    seconds=late,
                    load=machine_load(),
                    cpu=used,
                    test=test,
                    main_thread=main_thread_at(),
                    waited=waited,
                    memory=memory_between(since, memory),
                )
                self._stalls.append(stall)
            if now - sampled >= CPU_SAMPLE_EVERY:
                sampled = now
                self.samples.append(cpu_sample())

    def sample_before(self, at: float) -> CpuSample | None:
        """The last CPU sample taken at or before wall-clock time ``at``."""
        earlier = [sample for sample in list(self.samples) if sample.at <= at]
        return earlier[-1] if earlier else None

    def between(self, start: float, stop: float) -> list[Stall]:
        """Stalls that ended between two wall-clock times."""
        return [s for s in self._stalls if start <= s.ended <= stop + INTERVAL + LATE]

    def describe(self, stall: Stall) -> str:
        """The stall, with what each core's heartbeat did over it."""
        if self.cores is None:
            return str(stall)
        heard = self.cores.during(stall.ended - stall.seconds - INTERVAL, stall.ended)
        return f"{stall}\n    {heard}"


@dataclass(frozen=True)
class LoopStall:
    """A running event loop of the test that did not tick for ``LOOP_STALL`` seconds."""

    noticed: float  # wall clock
    last_tick: float  # wall clock
    stacks: str
    cpu: str

    def __str__(self) -> str:
        clock = time.strftime("%H:%M:%S", time.gmtime(self.last_tick))
        return (
            f"the test's event loop last ticked at {clock} UTC and had not ticked "
            f"{self.noticed - self.last_tick:.0f}s later; meanwhile:\n    {self.cpu}\n"
            f"  every thread's stack then:\n{self.stacks}"
        )


class LoopWatch:
    """Ticks every event loop the suite runs; dumps the stacks when one stops ticking."""

    def __init__(self, watch: StallWatch, after: float = LOOP_STALL) -> None:
        self.watch = watch
        self.after = after
        self.stalls: list[LoopStall] = []
        self._last_tick = time.time()
        # Appended to by faulthandler's C thread while ``_collect`` reads it:
        # O_APPEND puts every write at the end and ``os.pread`` leaves the
        # offset alone, so a read never moves where a dump still being
        # written goes (once, with a shared offset, a slow dump's second
        # half overwrote its first).
        self.dump = tempfile.TemporaryFile(mode="a+b", prefix="loop-stall-")
        self._read_up_to = 0
        # Loops with a tick scheduled (a loop run again keeps its one tick).
        self._ticking: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
        threading.Thread(target=self._collect, name="loop-watch", daemon=True).start()

    def started(self, loop: asyncio.AbstractEventLoop) -> None:
        # Armed now: the first callback may itself be the one that blocks.
        self._last_tick = time.time()
        faulthandler.dump_traceback_later(self.after, file=self.dump)
        if loop not in self._ticking:
            self._ticking.add(loop)
            loop.call_soon(self._tick, loop)

    def stopped(self) -> None:
        faulthandler.cancel_dump_traceback_later()

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._last_tick = time.time()
        faulthandler.dump_traceback_later(self.after, file=self.dump)
        loop.call_later(1.0, self._tick, loop)

    def _collect(self) -> None:
        """Turns what faulthandler dumped into a stall with the CPU used meanwhile."""
        fd = self.dump.fileno()
        while True:
            time.sleep(1.0)
            size = os.fstat(fd).st_size
            if size <= self._read_up_to:
                continue
            text = os.pread(fd, size - self._read_up_to, self._read_up_to)
            self._read_up_to = size
            self._add(text.decode(errors="replace"))

    def _add(self, text: str) -> None:
        """Each dump in ``text`` a stall; a dump read while faulthandler was
        still writing it (a slow, starved process) goes on in the next read,
        whose text before any new dump's header ends the last stall's stacks."""
        for part in DUMP_START.split(text):
            if not part:
                continue
            if not DUMP_START.match(part) and self.stalls:
                last = self.stalls[-1]
                self.stalls[-1] = replace(last, stacks=last.stacks + part)
                continue
            last_tick = self._last_tick
            before = self.watch.sample_before(last_tick)
            cpu = cpu_used(before, cpu_sample()) if before else "no CPU sample before it"
            if self.watch.cores is not None:
                cpu += "\n    " + self.watch.cores.during(last_tick, time.time())
            self.stalls.append(LoopStall(time.time(), last_tick, part, cpu))

    def between(self, start: float, stop: float) -> list[LoopStall]:
        return [s for s in self.stalls if start <= s.noticed <= stop + 2]


def watched_policy(loops: LoopWatch) -> asyncio.AbstractEventLoopPolicy:
    """An event loop policy whose loops tick for ``loops`` while they run."""

    class WatchedLoop(asyncio.SelectorEventLoop):
        def run_forever(self) -> None:
            loops.started(self)
            try:
                super().run_forever()
            finally:
                loops.stopped()

    class WatchedPolicy(asyncio.DefaultEventLoopPolicy):
        _loop_factory: Any = WatchedLoop

    return WatchedPolicy()


def busiest(sample: float = 0.5, top: int = 8) -> list[str]:
    """The processes that used the most CPU over ``sample`` seconds, now."""
    before: dict[int, tuple[psutil.Process, float]] = {}
    for proc in psutil.process_iter():
        try:
            times = proc.cpu_times()
            before[proc.pid] = (proc, times.user + times.system)
        except psutil.Error:
            pass
    time.sleep(sample)
    used = []
    for proc, was in before.values():
        try:
            times = proc.cpu_times()
            share = (times.user + times.system - was) / sample
            used.append((share, proc.pid, " ".join(proc.cmdline())[:120] or proc.name()))
        except psutil.Error:
            pass
    used.sort(reverse=True)
    return [f"{share:4.0%} {pid} {cmd}" for share, pid, cmd in used[:top]]


# What the kernel logs of a CPU that did not run its work (the workqueue and
# RCU watchdogs: 30 s and 21 s by default, so shorter stalls go unlogged).
KERNEL_STALL = ("workqueue lockup", "stuck for", "rcu_sched self-detected stall", "soft lockup")


def kernel_stalls(start: float, stop: float) -> list[str]:
    """The kernel's stall reports between two wall-clock times ([] if dmesg is not readable)."""
    try:
        out = subprocess.run(
            ["dmesg", "--time-format", "iso"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return stall_reports(out, start, stop)


def stall_reports(dmesg: str, start: float, stop: float) -> list[str]:
    """The lines of ``dmesg --time-format iso`` output that report a stall between two times."""
    found = []
    for line in dmesg.splitlines():
        stamp, _, message = line.partition(" ")
        if not any(sign in message for sign in KERNEL_STALL):
            continue
        try:
            when = datetime.fromisoformat(stamp.replace(",", ".")).timestamp()
        except ValueError:
            continue
        if start <= when <= stop:
            found.append(line)
    return found


# The start of the project's own log lines at WARNING and above (shared/logs,
# text format); vLLM's lines start otherwise and are not matched.
OWN_WARNING = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (WARNING|ERROR|CRITICAL) ")
# At most this many lines in a report (the last ones).
LOG_LINES_SHOWN = 40


def warnings_logged(logs: Iterable[Path], start: float, stop: float) -> list[str]:
    """The project's warnings and errors in ``logs`` stamped between two wall-clock
    times (a second's slack each side), each after its file's name, in time order."""
    found: list[tuple[float, str]] = []
    for path in logs:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            match = OWN_WARNING.match(line)
            if match is None:
                continue
            # Stamped in local time, to the millisecond.
            when = time.mktime(time.strptime(match[1], "%Y-%m-%d %H:%M:%S")) + int(match[2]) / 1000
            if start - 1 <= when <= stop + 1:
                found.append((when, f"{path.parent.name}/{path.name}: {line[:300]}"))
    found.sort(key=lambda entry: entry[0])  # several files: one timeline
    return [line for _, line in found[-LOG_LINES_SHOWN:]]


def report(
    watch: StallWatch,
    start: float,
    stop: float,
    logs: Iterable[Path] = (),
    loops: LoopWatch | None = None,
) -> str:
    stalls = watch.between(start, stop)
    lines = [f"now: {machine_load()}"]
    lines.append(
        "stalls of the test process during the test: "
        + ("none" if not stalls else "\n  " + "\n  ".join(map(watch.describe, stalls)))
    )
    if stalls:
        before = watch.sample_before(min(s.ended - s.seconds for s in stalls))
        if before is not None:
            lines.append("  " + cpu_used(before, cpu_sample()))
    loop_stalls = loops.between(start, stop) if loops else []
    lines.append(
        "stalls of the test's event loop during the test: "
        + ("none" if not loop_stalls else "\n  " + "\n  ".join(map(str, loop_stalls)))
    )
    kernel = kernel_stalls(start, stop)
    lines.append(
        "the kernel's stall reports during the test: "
        + ("none" if not kernel else "\n  " + "\n  ".join(kernel))
    )
    logged = warnings_logged(logs, start, stop)
    lines.append(
        "warnings the systems under test logged during the test: "
        + ("none" if not logged else "\n  " + "\n  ".join(logged))
    )
    lines.append("busiest processes just after it failed:\n  " + "\n  ".join(busiest()))
    return "\n".join(lines)
