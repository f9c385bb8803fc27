"""What the machine did while a test failed: stalls of the test process, load, busiest processes.

CI runs have failed in ways no local run reproduced, whose logs show the
test process acting minutes later than the system it tested. A daemon thread
here wakes every half second; a wake-up far later than asked means this
process (or the whole machine) did not run meanwhile. A failed test's report
gets a section listing the stalls during it, the machine's load then, and
the processes that used the most CPU just after it failed, and what the
kernel logged meanwhile of a CPU that made no progress: on the CI's virtual
machine it once reported one stuck for 34 s (its host did not run that
virtual CPU), and a process queued there gets no CPU at all meanwhile while
the rest of the machine runs on. A stall of another process (a gateway, a
worker) shows in what that process logged: the warnings and errors the
systems under test logged during the test are listed too (a late tick of
their event loop, a worker lost, a gateway given up on).
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil

INTERVAL = 0.5
# Seconds later than asked that count as a stall.
LATE = 2.0


@dataclass(frozen=True)
class Stall:
    ended: float  # wall clock
    seconds: float
    load: str

    def __str__(self) -> str:
        clock = time.strftime("%H:%M:%S", time.gmtime(self.ended))
        return f"{clock} UTC: {self.seconds:.1f} s late; {self.load}"


def machine_load() -> str:
    """Load averages and the CPU pressure (share of time some task waited for a core)."""
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        pressure = some.split()[1]  # avg10=...
    except (OSError, IndexError):
        pressure = "avg10=?"
    return f"load {load}, CPU pressure {pressure}"


class StallWatch:
    def __init__(self) -> None:
        self._stalls: list[Stall] = []
        threading.Thread(target=self._run, name="stall-watch", daemon=True).start()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(INTERVAL)
            now = time.monotonic()
            late = now - last - INTERVAL
            last = now
            if late > LATE:
                self._stalls.append(Stall(time.time(), late, machine_load()))

    def between(self, start: float, stop: float) -> list[Stall]:
        """Stalls that ended between two wall-clock times."""
        return [s for s in self._stalls if start <= s.ended <= stop + INTERVAL + LATE]


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


def report(watch: StallWatch, start: float, stop: float, logs: Iterable[Path] = ()) -> str:
    stalls = watch.between(start, stop)
    lines = [f"now: {machine_load()}"]
    lines.append(
        "stalls of the test process during the test: "
        + ("none" if not stalls else "\n  " + "\n  ".join(map(str, stalls)))
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
