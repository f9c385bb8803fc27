"""The job runner: takes batch jobs to their end, a few lines at a time, through the gateway itself.

Every gateway process and replica runs one over the shared state store
(``gateway.state.batches``): it claims pending lines under a lease, runs
each, commits its result, and claims more; a replica that dies leaves
leases that lapse, and the others run those lines again. A line is not sent
to a worker by a second path: it is a request to the gateway's own ASGI app
(below the API-key check), as its job's owner (``gateway.context``), so it
gets all an interactive request gets, limits and usage included. It runs at
low priority (``gateway.dispatch.admission``, ``protocol.BATCH_PRIORITY``),
capped in flight (:meth:`Runner.cap`), so interactive requests still find
free slots; a 429 or 503 is not its result but a reason to try again later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.types import ASGIApp, Message

from gateway import errors, metrics
from gateway.api.auth import KeyRing
from gateway.api.inner import own_request
from gateway.batch.jsonl import ENDPOINTS
from gateway.context import RequestContext
from gateway.state import State, Unavailable
from gateway.state.batches import ACTIVE, STATUSES, Batches, Ending, output_line
from gateway.state.db import owner_name
from gateway.state.lines import Claimed, Line
from shared.settings import BatchSettings

log = logging.getLogger(__name__)

# How often the runner looks for new, cancelled or ended jobs when nothing
# wakes it (a job created through another gateway process or replica).
POLL_SECONDS = 1.0
# Pauses between tries of a line the gateway could not take (429, 503).
RETRY_PAUSES = (1.0, 2.0, 5.0, 10.0, 30.0)
RETRIED_STATUSES = frozenset({429, 503})
# Interactive traffic counts as gone after this long without any.
QUIET_SECONDS = 5.0
# While interactive requests come in, batch lines may hold 1/INTERACTIVE_SHARE of the slots.
INTERACTIVE_SHARE = 128

_ENDINGS = {
    "completed": ("", ""),
    "expired": ("batch_expired", "the batch's completion window ended"),
    "cancelled": ("batch_cancelled", "the batch was cancelled"),
}


@dataclass
class Job:
    """A job this runner has lines of in flight."""

    batch_id: str
    expires_at: int
    # The id of the API key that created it (None: no keys then).
    owner: str | None = None
    running: int = 0
    # Set when the job is cancelled or past its window: its lines stop.
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


class Runner:
    def __init__(
        self,
        state: State,
        app: ASGIApp,
        capacity: Callable[[], int],
        interactive_since: Callable[[], float],
        settings: BatchSettings,
        keys: KeyRing | None = None,
    ) -> None:
        self.state = state
        self.app = app
        # The configured API keys (None or empty: none), to find a job's owner's.
        self.keys = keys
        # Slots of the healthy workers (Admission.capacity) and seconds since
        # the last interactive request (Pool.interactive_since): the default cap.
        self.capacity = capacity
        self.interactive_since = interactive_since
        self.max_inflight = settings.batch_max_inflight
        # A line's lease: renewed every third of it while the line runs, so a
        # replica that dies holds its lines at most this long.
        self.lease_seconds = settings.batch_lease_seconds
        # This runner among all replicas' (a restarted process is a new owner).
        self.owner = f"{owner_name()}:{secrets.token_hex(3)}"
        self.jobs: dict[str, Job] = {}
        self.in_flight = 0
        self._lines: set[asyncio.Task[None]] = set()
        # The lines those tasks run, (batch id, line): the leases renewed.
        self._running: set[tuple[str, int]] = set()
        self._wake = asyncio.Event()
        self._surveyed = 0.0
        self._renewed = 0.0
        # Whether the store held a job to run or end at the last survey (any
        # replica's): with none, a look asks the store for nothing more.
        self._active = True
        self._down = False
        self._task: asyncio.Task[None] | None = None

    @property
    def batches(self) -> Batches:
        return self.state.batches

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch runner")

    async def stop(self) -> None:
        """Stop working and give this runner's leases back: another replica (or
        this gateway's next start) runs those lines; nothing is lost."""
        tasks = [*self._lines, *([self._task] if self._task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.state.ready.is_set():
            with contextlib.suppress(Unavailable):
                await asyncio.to_thread(self.batches.lines.release_all, self.owner)

    def wake(self) -> None:
        """A job was created or cancelled in this process: look now, not at the next poll."""
        self._surveyed = 0.0  # and survey the jobs again
        self._wake.set()

    def cap(self) -> int:
        """Lines in flight at once: ``--batch-max-inflight`` if set; else a
        128th of the slots while interactive requests are about, half of them
        once there have been none for ``QUIET_SECONDS``.

        A running batch line shares every engine step with the interactive
        requests: on the 2-core CPU worker, 4 users' chat requests took 1.56x
        as long (median) with a 32nd of the slots (8 lines) in flight
        (``make loadtest ARGS="--scenario batch"``, docs/benchmarks.md). Alone,
        a batch may use more, but never every slot: an interactive request
        arriving then still finds one free.
        """
        if self.max_inflight:
            return self.max_inflight
        slots = self.capacity()
        if self.interactive_since() < QUIET_SECONDS:
            return max(1, slots // INTERACTIVE_SHARE)
        return max(1, slots // 2)

    async def _run(self) -> None:
        await self.state.ready.wait()
        log.info("batch runner %s started (state in %s)", self.owner, self.state.db.where)
        while True:
            self._wake.clear()
            try:
                await self._look()
                if self._down:
                    log.info("batch runner: the state store answers again")
                    self._down = False
            except Unavailable as exc:
                # Lines in flight finish; their results are committed once the
                # store is back, or their leases lapse and they run again.
                if not self._down:
                    log.warning("batch runner: the state store does not answer (%s)", exc)
                    self._down = True
            except Exception:
                log.exception("batch runner: a look at the jobs failed; trying again")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_SECONDS):
                    await self._wake.wait()

    async def _look(self) -> None:
        """Claim lines there is room for; now and then, take jobs further."""
        now = time.monotonic()
        if now - self._surveyed >= POLL_SECONDS:
            self._surveyed = now
            await self._survey()
        if not (self._active or self._lines or self.jobs):
            return
        if self._lines and now - self._renewed >= self.lease_seconds / 3:
            self._renewed = now
            running = list(self._running)
            await asyncio.to_thread(
                self.batches.lines.renew, self.owner, self.lease_seconds, running
            )
        room = self.cap() - self.in_flight
        while room > 0:
            claimed = await asyncio.to_thread(
                self.batches.lines.claim, self.owner, room, self.lease_seconds
            )
            # A line of ours whose lease lapsed while it ran (this loop was late
            # past the lease) comes back, its lease now renewed: it runs once,
            # and the room it took is claimed again.
            fresh = [c for c in claimed if (c.batch_id, c.line.index) not in self._running]
            for line in fresh:
                self._start(line)
            if len(fresh) == len(claimed):
                return
            room = self.cap() - self.in_flight

    async def _survey(self) -> None:
        """Start new jobs, stop lines of cancelled or expired ones, end finished ones."""
        batches = self.batches
        counts = await asyncio.to_thread(batches.job_counts)
        self._active = any(counts[status] for status in ACTIVE)
        if not (self._active or self.jobs):
            self._count(counts)
            return  # an idle store: one question a second
        for batch_id in await asyncio.to_thread(batches.start_validated):
            log.info("batch %s: in progress", batch_id)
        if self.jobs:
            statuses = await asyncio.to_thread(batches.statuses, list(self.jobs))
            for batch_id, job in self.jobs.items():
                if statuses.get(batch_id) != "in_progress" or time.time() >= job.expires_at:
                    job.cancelled.set()
        # Jobs whose lines are all done, cancelled or past their window: ended
        # by whichever replica takes the lease on ending it.
        for ending in await asyncio.to_thread(batches.ending):
            if await asyncio.to_thread(
                batches.take, ending.batch_id, self.owner, self.lease_seconds
            ):
                await self._end(ending)
        self._count(await asyncio.to_thread(batches.job_counts))

    @staticmethod
    def _count(counts: dict[str, int]) -> None:
        for status in STATUSES:
            metrics.child(metrics.BATCH_JOBS, status).set(counts[status])

    # -- one line ------------------------------------------------------------------

    def _start(self, claimed: Claimed) -> None:
        job = self.jobs.get(claimed.batch_id)
        if job is None:
            job = self.jobs[claimed.batch_id] = Job(
                claimed.batch_id, claimed.expires_at, claimed.owner
            )
        job.running += 1
        self.in_flight += 1
        self._running.add((claimed.batch_id, claimed.line.index))
        task = asyncio.create_task(self._line(job, claimed))
        self._lines.add(task)
        task.add_done_callback(self._lines.discard)

    async def _line(self, job: Job, claimed: Claimed) -> None:
        line = claimed.line
        try:
            outcome = await self._outcome(job, line, claimed.cache)
            if outcome is None:
                # Cancelled, or past the window: unrun, the error file says so.
                await asyncio.to_thread(
                    self.batches.lines.release, self.owner, job.batch_id, line.index
                )
                return
            status, request_id, body = outcome
            failed = status != 200
            result = output_line(line.custom_id, status, request_id, body)
            committed = await asyncio.to_thread(
                self.batches.lines.finish_line, self.owner, job.batch_id, line.index, failed, result
            )
            if committed:
                metrics.child(metrics.BATCH_LINES, "failed" if failed else "completed").inc()
            else:
                log.warning(
                    "batch %s line %d: its lease lapsed and another replica took the line "
                    "over before its result was committed; that replica's answer counts",
                    job.batch_id,
                    line.index,
                )
        except Unavailable as exc:
            log.warning(
                "batch %s line %d: the state store does not answer (%s); it runs again "
                "once its lease lapses",
                job.batch_id,
                line.index,
                exc,
            )
        finally:
            self._running.discard((job.batch_id, line.index))
            self.in_flight -= 1
            job.running -= 1
            if job.running == 0:
                self.jobs.pop(job.batch_id, None)
            self._wake.set()

    async def _outcome(self, job: Job, line: Line, cache: bool) -> tuple[int, str, Any] | None:
        """The line's answer, tried again while the gateway is busy (429, 503,
        but not a 429 that waiting cannot help); None if the job was cancelled
        or its window ended first."""
        attempt = 0
        while True:
            if job.cancelled.is_set() or time.time() >= job.expires_at:
                return None
            outcome = await self._call(job, line, cache)
            if outcome is None:
                return None
            status, request_id, body, waiting_helps = outcome
            if status not in RETRIED_STATUSES or (status == 429 and not waiting_helps):
                # Its answer (a 429 without Retry-After: the line alone is over
                # its key's tokens a minute, refused for as long as it is tried).
                return status, request_id, body
            pause = RETRY_PAUSES[min(attempt, len(RETRY_PAUSES) - 1)]
            attempt += 1
            if time.time() + pause >= job.expires_at:
                return None
            log.debug(
                "batch %s line %d: %d, trying again in %.0fs",
                job.batch_id,
                line.index,
                status,
                pause,
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await job.cancelled.wait()

    async def _call(self, job: Job, line: Line, cache: bool) -> tuple[int, str, Any, bool] | None:
        """The line as a request to the gateway's app: (status, request id, body,
        whether the answer said when to try again), or None if the job was
        cancelled first."""
        if line.url not in ENDPOINTS:
            refused = errors.BadRequest(f"No batch endpoint {line.url}.", "url")
            return 400, "", refused.body(), False
        request_id = f"{job.batch_id}-{line.index}"
        # The owner's key as the keys are now, by id: a key revoked since (or
        # whose name was given to a new secret: another id) gets an error answer.
        key = None
        if job.owner is not None and self.keys is not None and len(self.keys):
            key = self.keys.with_id(job.owner)
            if key is None:
                revoked = errors.Unauthorized(
                    f"The API key (id {job.owner!r}) that created this batch was revoked."
                )
                return revoked.status, request_id, revoked.body(), False
        # A batch fills the cache only when asked to (precompute).
        no_store = () if cache else ((b"cache-control", b"no-store"),)
        status = 0
        retry_after = False
        chunks: list[bytes] = []

        async def send(message: Message) -> None:
            nonlocal status, retry_after
            if message["type"] == "http.response.start":
                status = message["status"]
                retry_after = any(k.lower() == b"retry-after" for k, _ in message["headers"])
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        context = RequestContext(key=key, batch=True)
        await own_request(
            self.app, line.url, line.body, request_id, context, job.cancelled, send, no_store
        )
        if job.cancelled.is_set() and status in (0, 499):
            return None
        raw = b"".join(chunks)
        try:
            body = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            body = raw.decode(errors="replace")
        return status, request_id, body, retry_after

    # -- ending a job -----------------------------------------------------------------

    async def _end(self, ending: Ending) -> None:
        """Write the job's output and error files and give it its final status."""
        code, why = _ENDINGS[ending.status]
        batch, unrun = await asyncio.to_thread(
            self.batches.finalize,
            ending.batch_id,
            ending.status,
            code,
            f"This request did not run: {why}.",
        )
        if unrun:
            metrics.child(metrics.BATCH_LINES, ending.status).inc(unrun)
        counts = batch["request_counts"]
        log.info(
            "batch %s %s: %d completed, %d failed, %d not run",
            ending.batch_id,
            ending.status,
            counts["completed"],
            counts["failed"],
            unrun,
        )
