"""Each process's usage, added up in memory as requests finish and flushed to the store.

A request's usage is recorded on the event loop (:meth:`Ledger.record`: a
dict update, no I/O), never written on its way out. Every
``FLUSH_SECONDS`` what was recorded since becomes one flush, added in one
transaction from a thread (``gateway.state.usage``), and once more when the
gateway stops.

A flush the store did not take (it is down, or has not answered yet) stays
in memory, unchanged and under its id, and is tried again at the next tick
while new usage gathers into the next flush: nothing is lost while the
store is away, and a flush whose commit went through but whose answer was
lost is recognised by its id and not added twice. Only a process that stops
while the store is still away loses what it had not flushed (the log says
how much).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time

from gateway.state.db import Unavailable, owner_name
from gateway.state.usage import Counts, Row, Usage

log = logging.getLogger(__name__)

FLUSH_SECONDS = 2.0


class Ledger:
    def __init__(self, usage: Usage, ready: asyncio.Event) -> None:
        self.usage = usage
        # Set once the store has answered (and is migrated): flushes wait for it.
        self.ready = ready
        # Flush ids: this process (a restarted one is another), then a serial.
        self._source = f"{owner_name()}:{secrets.token_hex(4)}"
        self._serial = itertools.count()
        # Recorded since the last flush was cut.
        self._open: dict[Row, Counts] = {}
        # Each key id's name, as its last request had it (what usage rows show).
        self._names: dict[str, str] = {}
        # A flush cut but not known to be in the store, tried until it is.
        self._unsent: tuple[str, dict[Row, Counts]] | None = None
        self._lock = asyncio.Lock()
        # Today (UTC) and when it ends: formatted once a day, not per request.
        self._day = ""
        self._day_ends = 0.0
        self._down = False
        self._task: asyncio.Task[None] | None = None

    def record(
        self, key: str, model: str, prompt: int, completion: int, cached: int = 0, name: str = ""
    ) -> None:
        """One finished request of the key whose id is ``key`` (named ``name``;
        "": the id) on ``model`` today (UTC)."""
        if name and self._names.get(key) != name:
            self._names[key] = name
        day = self.today()
        counts = self._open.get((key, model, day))
        if counts is None:
            counts = self._open[key, model, day] = Counts()
        counts.requests += 1
        counts.prompt_tokens += prompt
        counts.completion_tokens += completion
        counts.cached_tokens += cached

    def today(self) -> str:
        """The UTC date usage is counted under now (``YYYY-MM-DD``)."""
        now = time.time()
        if now >= self._day_ends:
            self._day = time.strftime("%Y-%m-%d", time.gmtime(now))
            self._day_ends = (now // 86400 + 1) * 86400
        return self._day

    def pending(self) -> Counts:
        """What this process recorded that is not (known to be) in the store yet."""
        total = Counts()
        for counts in [*self._open.values(), *(self._unsent[1].values() if self._unsent else ())]:
            total.add(counts)
        return total

    async def flush(self) -> bool:
        """Add what was recorded to the store; whether all of it is there now."""
        async with self._lock:
            while True:
                if self._unsent is None:
                    if not self._open:
                        return True
                    self._unsent = (f"{self._source}:{next(self._serial)}", self._open)
                    self._open = {}
                if not self.ready.is_set():
                    return False
                flush_id, rows = self._unsent
                try:
                    await asyncio.to_thread(self.usage.add, flush_id, rows, dict(self._names))
                except Unavailable as exc:
                    if not self._down:
                        log.warning("usage: the state store does not answer (%s); kept", exc)
                        self._down = True
                    return False
                if self._down:
                    log.info("usage: the state store answers again; flushed what was kept")
                    self._down = False
                self._unsent = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            try:
                await self.flush()
            except Exception:
                # Kept, and tried again at the next tick.
                log.exception("usage: a flush failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage ledger")

    async def stop(self) -> None:
        """Stop the ticks and flush what is left (once: the gateway is stopping)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            flushed = await self.flush()
        except Exception:
            log.exception("usage: the last flush failed")
            flushed = False
        if not flushed:
            lost = self.pending()
            log.error(
                "usage: the state store did not take the last %d requests' usage "
                "(%d prompt, %d completion tokens): not recorded",
                lost.requests,
                lost.prompt_tokens,
                lost.completion_tokens,
            )
