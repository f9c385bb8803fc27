"""The job runner: takes each batch job to its end, one line at a time through the gateway itself.

A line is not sent to a worker by a second path: it is a request to the
gateway's own ASGI app (below the API-key check), with a synthetic HTTP
scope, its body, a request id of its own and ``scope["llmgate.priority"] =
"batch"``. So it gets everything an interactive request gets (validation,
model resolution, admission, the response cache, metrics, logs) and the
answer a client would get. Admission puts it behind every interactive
request (``gateway.admission``), the worker's engine runs it at a lower
priority (``protocol.BATCH_PRIORITY``), and the runner caps its lines in
flight (``cap``), so interactive requests always find free slots and the
batch slows them little.

A line is done once its result row is committed (``Store.finish_line``);
a 429 or 503 (the gateway busy, no worker up) is not a result: the line is
tried again after a pause. Cancelling a job ends its in-flight lines as a
client that goes away would (the request is aborted on its worker). With
``--processes N`` only the process holding the lock file in the state
directory runs jobs; the others look for the lock now and then, so one takes
over if that process dies. Jobs are found in the database, so a job created
through any process, or left unfinished by a killed gateway, is picked up.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.types import ASGIApp, Message

from gateway import errors, metrics
from gateway.api.request_ids import HEADER as REQUEST_ID_HEADER
from gateway.batch.jsonl import ENDPOINTS, Line
from gateway.batch.store import ACTIVE, STATUSES, Store, output_line

log = logging.getLogger(__name__)

# How often the runner looks for new, cancelled or orphaned jobs when nothing
# wakes it (a job created through another gateway process).
POLL_SECONDS = 1.0
LOCK_RETRY_SECONDS = 5.0
# Pauses between tries of a line the gateway could not take (429, 503).
RETRY_PAUSES = (1.0, 2.0, 5.0, 10.0, 30.0)
RETRIED_STATUSES = frozenset({429, 503})
# Interactive traffic counts as gone after this long without any.
QUIET_SECONDS = 5.0
# While interactive requests come in, batch lines may hold 1/INTERACTIVE_SHARE of the slots.
INTERACTIVE_SHARE = 128
# Precompute: a job created with this metadata fills the response cache.
CACHE_METADATA_KEY = "llmgate_cache"


@dataclass
class Job:
    """A job the runner is working on, and the lines it has in flight."""

    batch_id: str
    task: asyncio.Task[None] | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


class Runner:
    def __init__(
        self,
        store: Store,
        app: ASGIApp,
        capacity: Callable[[], int],
        interactive_since: Callable[[], float],
        max_inflight: int,
    ) -> None:
        self.store = store
        self.app = app
        # Slots of the healthy workers (Admission.capacity) and seconds since
        # the last interactive request (Pool.interactive_since): the default cap.
        self.capacity = capacity
        self.interactive_since = interactive_since
        self.max_inflight = max_inflight
        self.jobs: dict[str, Job] = {}
        self.in_flight = 0
        self._slot_freed = asyncio.Condition()
        self._wake = asyncio.Event()
        self._lock_fd: int | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch runner")

    async def stop(self) -> None:
        """Stop working (a running job resumes at the next start: nothing is lost)."""
        tasks = [job.task for job in self.jobs.values() if job.task is not None]
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)

    def wake(self) -> None:
        """A job was created or cancelled in this process: look now, not at the next poll."""
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
        # Another process of this gateway runs the jobs: take over if it dies.
        while True:
            if self._take_lock():
                break
            await asyncio.sleep(LOCK_RETRY_SECONDS)
        log.info("batch runner started (state in %s)", self.store.directory)
        while True:
            self._wake.clear()
            await self._look()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_SECONDS):
                    await self._wake.wait()

    def _take_lock(self) -> bool:
        """Whether this process is now the one that runs jobs."""
        path = self.store.directory / "runner.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    async def _look(self) -> None:
        """Start what is new, cancel what was cancelled, count jobs by status."""
        active = await asyncio.to_thread(self.store.active_batches)
        for batch_id, status in active:
            job = self.jobs.get(batch_id)
            if job is None:
                job = self.jobs[batch_id] = Job(batch_id)
                job.task = asyncio.create_task(self._job(job), name=f"batch {batch_id}")
            if status == "cancelling":
                job.cancelled.set()
        counts = await asyncio.to_thread(self.store.job_counts)
        for status in STATUSES:
            metrics.child(metrics.BATCH_JOBS, status).set(counts[status])

    # -- one job -----------------------------------------------------------------

    async def _job(self, job: Job) -> None:
        batch_id = job.batch_id
        try:
            batch = await asyncio.to_thread(
                self.store.set_status, batch_id, "in_progress", ("validating",)
            )
            assert batch is not None
            if batch["status"] not in ACTIVE:
                return  # ended while the last look was reading it
            if batch["status"] == "in_progress":
                log.info("batch %s: running %d lines", batch_id, batch["request_counts"]["total"])
                await self._lines(job, batch)
            await self._finalize(job)
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug or a broken state directory: logged, and retried at the next
            # look (the job is still active in the database).
            log.exception("batch %s: the runner failed; trying again", batch_id)
            await asyncio.sleep(POLL_SECONDS)
        finally:
            self.jobs.pop(batch_id, None)
            self.wake()

    async def _lines(self, job: Job, batch: dict[str, Any]) -> None:
        pending = await asyncio.to_thread(self.store.pending_lines, job.batch_id)
        cache = (batch.get("metadata") or {}).get(CACHE_METADATA_KEY) == "true"
        running: set[asyncio.Task[None]] = set()
        try:
            for line in pending:
                if not await self._slot(job, batch["expires_at"]):
                    break
                task = asyncio.create_task(self._line(job, line, cache, batch["expires_at"]))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running)
        finally:
            # Stopping (or a failure): what is in flight stops, and runs again
            # at the next start, since its result was never committed.
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _slot(self, job: Job, expires_at: int) -> bool:
        """Wait for room under the cap; False if the job was cancelled or expired meanwhile."""
        async with self._slot_freed:
            while self.in_flight >= self.cap():
                if job.cancelled.is_set():
                    return False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_SECONDS):
                        await self._slot_freed.wait()
            if job.cancelled.is_set() or time.time() >= expires_at:
                return False
            self.in_flight += 1
            return True

    async def _line(self, job: Job, line: Line, cache: bool, expires_at: int) -> None:
        attempt = 0
        try:
            while True:
                outcome = await self._call(job, line, cache)
                if outcome is None:
                    return  # cancelled: stays pending, the error file says so
                status, request_id, body = outcome
                if status not in RETRIED_STATUSES:
                    break
                pause = RETRY_PAUSES[min(attempt, len(RETRY_PAUSES) - 1)]
                attempt += 1
                if time.time() + pause >= expires_at:
                    return  # stays pending: the error file says it expired
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
                if job.cancelled.is_set():
                    return
            failed = status != 200
            result = output_line(line.custom_id, status, request_id, body)
            await asyncio.to_thread(
                self.store.finish_line, job.batch_id, line.index, failed, result
            )
            metrics.child(metrics.BATCH_LINES, "failed" if failed else "completed").inc()
        finally:
            async with self._slot_freed:
                self.in_flight -= 1
                self._slot_freed.notify()

    async def _call(self, job: Job, line: Line, cache: bool) -> tuple[int, str, Any] | None:
        """The line as a request to the gateway's app: (status, request id, body),
        or None if the job was cancelled first."""
        if line.url not in ENDPOINTS:
            return 400, "", errors.BadRequest(f"No batch endpoint {line.url}.", "url").body()
        request_id = f"{job.batch_id}-{line.index}"
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(line.body)).encode()),
            (REQUEST_ID_HEADER, request_id.encode()),
        ]
        if not cache:
            # A batch fills the cache only when asked to (precompute).
            headers.append((b"cache-control", b"no-store"))
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": line.url,
            "raw_path": line.url.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": None,
            "server": None,
            "state": {},
            "llmgate.priority": "batch",
        }
        sent_body = False
        status = 0
        chunks: list[bytes] = []

        async def receive() -> Message:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": line.body, "more_body": False}
            # Then as a client that stays until it is cancelled: the app
            # watches for this while the request waits or runs.
            await job.cancelled.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        if job.cancelled.is_set() and status in (0, 499):
            return None
        raw = b"".join(chunks)
        try:
            body = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            body = raw.decode(errors="replace")
        return status, request_id, body

    async def _finalize(self, job: Job) -> None:
        """Write the job's output and error files and give it its final status."""
        batch_id = job.batch_id
        now = await asyncio.to_thread(
            self.store.set_status, batch_id, "finalizing", ("in_progress",)
        )
        assert now is not None
        counts = now["request_counts"]
        unrun = counts["total"] - counts["completed"] - counts["failed"]
        if now["status"] == "cancelling" or job.cancelled.is_set():
            final, code, why = "cancelled", "batch_cancelled", "the batch was cancelled"
        elif unrun:
            final, code, why = "expired", "batch_expired", "the batch's completion window ended"
        else:
            final, code, why = "completed", "", ""
        batch, unrun = await asyncio.to_thread(
            self.store.finalize, batch_id, final, code, f"This request did not run: {why}."
        )
        if unrun:
            metrics.child(metrics.BATCH_LINES, final).inc(unrun)
        counts = batch["request_counts"]
        log.info(
            "batch %s %s: %d completed, %d failed, %d not run",
            batch_id,
            final,
            counts["completed"],
            counts["failed"],
            unrun,
        )
