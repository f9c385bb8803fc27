"""A periodic loop's own lateness: was this process stalled, or its peers silent?

The gateway's monitor and the worker's heartbeat loop judge a peer silent
when nothing came from it for a while. When the loop itself woke far later
than it asked (the process was stopped, starved of CPU, or its own work held
the event loop), what the peers sent meanwhile is still unread: the silence
is this process's, and is judged on a later tick. Each such tick is logged
with the CPU this process used meanwhile, which tells the two causes apart:
less than half the delay (paused or starved by the machine), or more (work
in this process blocked its event loop: a bug to look for). That CPU is all
the process's threads' (ZeroMQ's I/O thread, a tokenizer's), so threads
busy beside a starved loop can make it read as the second.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class Ticks:
    def __init__(self, interval: float, who: str, judged: str) -> None:
        """``interval``: the loop's period; for the log, ``who`` ("gateway")
        and what a late tick leaves unjudged ("workers' silence")."""
        self.interval = interval
        self.who = who
        self.judged = judged
        self._last = time.monotonic()
        self._cpu = time.process_time()

    def late(self) -> bool:
        """Call once a tick, after its sleep: True when it woke too late to judge."""
        now, cpu = time.monotonic(), time.process_time()
        late = now - self._last - self.interval
        used = cpu - self._cpu
        self._last, self._cpu = now, cpu
        if late <= self.interval + 1.0:
            return False
        cause = (
            "work in this process held its event loop"
            if used > 0.5 * (late + self.interval)
            else "the process was paused or starved of CPU"
        )
        log.warning(
            "this %s's event loop woke %.1fs late (%s: %.1fs of CPU used meanwhile): "
            "%s is judged on a later tick",
            self.who,
            late,
            cause,
            used,
            self.judged,
        )
        return True
