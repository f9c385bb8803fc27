"""One heartbeat process pinned to each core: tells a core nobody else got from a busy machine.

When the test process is stalled with no CPU used (tests/harness/stall_watch.py),
either the cores ran other work and it waited its turn, or one core was not
shared at all: its host did not run that virtual CPU, or one task kept it
(the suite's runs showed a CPU engine's model runner, bound to core 0,
keeping it for over 20 s while the other core was busy too). A process
pinned to one core that wakes every half second tells them apart: on a core
that is shared, it is woken within milliseconds (even beside a spinning
process of the highest priority), so a wake-up seconds late means nothing
else got that core meanwhile; how the core's time was counted then (user
time: a task kept it; steal: the host took it) says which. It is a process,
not a thread of the test process, which could not run without the test
process's GIL.

Each heartbeat writes its late wake-ups to a file and exits when the
process that started it is gone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

INTERVAL = 0.5
# Seconds later than asked that count (as the stall watch's LATE).
LATE = 2.0

# A late wake-up is written with the direct reclaims and compaction stalls
# the kernel counted meanwhile (/proc/vmstat: work it does in the task that
# allocates, on that task's core), and how the core's own time was counted
# meanwhile (its /proc/stat line, in seconds): user or system time means
# something ran there, iowait that it idled while a read or write was
# pending, steal that the host took the core, irq or softirq interrupts.
_BEAT = """
import os, sys, time
core, interval, late_after = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
parent = os.getppid()
os.sched_setaffinity(0, {core})
def memory_work():
    counts = [0, 0]
    with open("/proc/vmstat") as vmstat:
        for line in vmstat:
            if line.startswith("allocstall"):
                counts[0] += int(line.split()[1])
            elif line.startswith("compact_stall"):
                counts[1] += int(line.split()[1])
    return counts
KINDS = ("user", "system", "idle", "iowait", "irq", "softirq", "steal")
FIELDS = (0, 2, 3, 4, 5, 6, 7)
TICK = os.sysconf("SC_CLK_TCK")
def core_times():
    with open("/proc/stat") as stat:
        for line in stat:
            if line.startswith(f"cpu{core} "):
                values = line.split()[1:]
                return [int(values[i]) / TICK for i in FIELDS]
    return [0.0] * len(FIELDS)
last, last_work, last_times = time.monotonic(), memory_work(), core_times()
out = open(sys.argv[4], "a", buffering=1)  # made now: a wake-up late from here on is told
while os.getppid() == parent:
    time.sleep(interval)
    now, work, times = time.monotonic(), memory_work(), core_times()
    late = now - last - interval
    reclaims, compactions = work[0] - last_work[0], work[1] - last_work[1]
    counted = ",".join(f"{k}={b - a:.1f}" for k, a, b in zip(KINDS, last_times, times))
    last, last_work, last_times = now, work, times
    if late > late_after:
        out.write(f"{time.time():.3f} {late:.3f} {reclaims} {compactions} {counted}\\n")
"""


@dataclass(frozen=True)
class LateBeat:
    core: int
    ended: float  # wall clock
    seconds: float
    reclaims: int = 0  # direct reclaims the kernel counted meanwhile
    compactions: int = 0  # and compaction stalls
    counted: str = ""  # how the core's time was counted meanwhile ("user=3.0,system=0.1,...")

    def __str__(self) -> str:
        clock = time.strftime("%H:%M:%S", time.gmtime(self.ended))
        return (
            f"{clock} UTC: core {self.core} {self.seconds:.1f} s late "
            f"({self.reclaims} direct reclaims, {self.compactions} compaction stalls meanwhile; "
            f"the core's time counted as {self.counted.replace(',', ' ')})"
        )

    def overlaps(self, start: float, stop: float) -> bool:
        return self.ended - self.seconds <= stop and self.ended >= start


class CpuHeartbeats:
    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="cpu-heartbeats-"))
        self.cores = sorted(os.sched_getaffinity(0))
        self.processes = {
            core: subprocess.Popen(
                # -I -S: no site packages, nothing but the few lines above to start.
                [sys.executable, "-I", "-S", "-c", _BEAT, *self._arguments(core)],
                stdin=subprocess.DEVNULL,
            )
            for core in self.cores
        }

    def _arguments(self, core: int) -> list[str]:
        return [str(core), str(INTERVAL), str(LATE), str(self._path(core))]

    def _path(self, core: int) -> Path:
        return self.directory / f"core-{core}.txt"

    def running(self) -> bool:
        """Every heartbeat is beating (its file made: its late wake-ups are told from then)."""
        return all(self._path(core).exists() for core in self.cores)

    def late_beats(self) -> list[LateBeat]:
        beats = []
        for core in self.cores:
            try:
                lines = self._path(core).read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                ended, seconds, reclaims, compactions, counted = line.split()
                beats.append(
                    LateBeat(
                        core, float(ended), float(seconds), int(reclaims), int(compactions), counted
                    )
                )
        return beats

    def during(self, start: float, stop: float) -> str:
        """Each core's heartbeat over a stall of the test process from ``start`` to ``stop``
        (wall clock): how late it woke, or that it woke on time."""
        late = [beat for beat in self.late_beats() if beat.overlaps(start, stop)]
        parts = []
        for core in self.cores:
            worst = max((b.seconds for b in late if b.core == core), default=0.0)
            if worst:
                parts.append(f"core {core} {worst:.1f} s late")
            else:
                parts.append(f"core {core} on time")
        if not all(proc.poll() is None for proc in self.processes.values()):
            parts.append("(a heartbeat process has exited)")
        return "cores' heartbeats: " + ", ".join(parts)

    def stop(self) -> None:
        for proc in self.processes.values():
            proc.terminate()
        for proc in self.processes.values():
            proc.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)
