"""The background runner: runs background responses and resumable streams to their end,
with every other replica.

Every gateway process runs one over the shared state store
(``gateway.state.background``). It claims queued ones (and those whose
replica's lease lapsed) and runs each as a streamed request to its route
(``/v1/responses``, or a resumable chat or completion stream's) on the
gateway's own app, as its owner's key (``gateway.api.inner``): the same
admission, routing, retries, limits and usage as a client's request.
Each event of the stream is stored, numbered, as it comes (a few at a time:
one write per batch of events, while the previous write is under way) for
any replica's readers (``gateway.background.follow``); the last event ends
the response with its stored record. A run that breaks before its last event
(its worker lost mid-answer) runs again, up to ``--max-migrations`` times,
and so does a response another replica left: the new run goes on after the
events already sent when it repeats them (``gateway.background.splice``), and
fails the response when it does not. A response cancelled, or taken over by
another replica after this one's lease lapsed, stops here at its next write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from typing import Any

import msgspec
from starlette.types import ASGIApp, Message

from gateway.api.auth import KeyRing
from gateway.api.inner import own_request
from gateway.api.responses import Record
from gateway.background.follow import Notices
from gateway.background.kinds import kind_of
from gateway.background.listen import listen
from gateway.background.splice import Diverged, Splice
from gateway.context import RequestContext
from gateway.state import State, Unavailable
from gateway.state.background import Claimed
from gateway.state.db import POSTGRES_CONNECT_ARGS, owner_name

log = logging.getLogger(__name__)

# How often the runner looks for responses to run when nothing wakes it
# (one created through another replica, or one whose replica's lease lapsed).
POLL_SECONDS = 1.0
# Background responses one process runs at once (each waits in admission's
# queue like any request; these are only what it has claimed).
MOST_AT_ONCE = 64
# Pauses before running again a response the gateway could not take (429, 503).
RETRY_PAUSES = (1.0, 2.0, 5.0, 10.0, 30.0)
# The store did not take a write: tried again after this long.
STORE_PAUSE = 1.0
# A stored response's fields every event of its stream keeps from the first run.
FIXED = ("id", "created_at", "background", "store", "previous_response_id")


class Runner:
    def __init__(
        self,
        state: State,
        app: ASGIApp,
        lease_seconds: float,
        max_runs: int,
        keys: KeyRing | None = None,
    ) -> None:
        self.state = state
        self.app = app
        self.lease_seconds = lease_seconds
        # Runs of one response in this process: the first and its runs again.
        self.max_runs = max_runs
        self.keys = keys
        self.owner = f"{owner_name()}:{secrets.token_hex(3)}"
        self.notices = Notices()
        # The responses it runs: set to stop one (cancelled, or taken over).
        self.running: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._renewed = 0.0
        self._task: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._notifier: asyncio.Task[None] | None = None
        # Responses with new events (or ended) that other replicas are yet to hear of.
        self._changed: set[str] = set()
        self._changes = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="background runner")
        db = self.state.db
        if db.postgres:
            # Other replicas' stored events wake this one's readers at once,
            # and this one's wake theirs.
            listening = listen(db.conninfo(), POSTGRES_CONNECT_ARGS, self.notices)
            self._listener = asyncio.create_task(listening, name="background notifications")
            self._notifier = asyncio.create_task(self._notify(), name="background notices out")

    async def stop(self) -> None:
        """Stop, and give the leases back: another replica (or this gateway's
        next start) goes on with those responses."""
        started = (self._task, self._listener, self._notifier)
        tasks = [*self._tasks, *(task for task in started if task is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.state.ready.is_set():
            with contextlib.suppress(Unavailable):
                await asyncio.to_thread(self.state.background.release_all, self.owner)

    def wake(self) -> None:
        """A response was created in this process: claim it now."""
        self._wake.set()

    def changed(self, response_id: str) -> None:
        """It has new events stored, or it ended: its readers here look now, and
        (on PostgreSQL) those of other replicas once the store tells them."""
        self.notices.tell(response_id)
        if self._notifier is not None:
            self._changed.add(response_id)
            self._changes.set()

    async def _notify(self) -> None:
        """Tells the store what changed, a batch at a time: one notifying
        transaction per batch, while the one before is under way."""
        while True:
            await self._changes.wait()
            self._changes.clear()
            changed, self._changed = self._changed, set()
            try:
                await asyncio.to_thread(self.state.background.notify, changed)
            # Best effort: without the notice, other replicas' readers look on their own.
            except Exception as exc:
                log.debug("background streams: no notice sent (%s)", exc)

    def stop_one(self, response_id: str) -> None:
        """It was cancelled through this process: stop running it now."""
        leave = self.running.get(response_id)
        if leave is not None:
            leave.set()

    async def _run(self) -> None:
        await self.state.ready.wait()
        while True:
            self._wake.clear()
            try:
                await self._look()
            except Unavailable as exc:
                log.warning("background runner: the state store does not answer (%s)", exc)
            except Exception:
                log.exception("background runner: a look failed; trying again")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_SECONDS):
                    await self._wake.wait()

    async def _look(self) -> None:
        store = self.state.background
        now = time.monotonic()
        if self.running and now - self._renewed >= self.lease_seconds / 3:
            self._renewed = now
            held = await asyncio.to_thread(
                store.renew, self.owner, self.lease_seconds, list(self.running)
            )
            for response_id, leave in self.running.items():
                if response_id not in held:
                    leave.set()  # cancelled, or another replica took it over
        room = MOST_AT_ONCE - len(self.running)
        if room <= 0:
            return
        for claimed in await asyncio.to_thread(store.claim, self.owner, room, self.lease_seconds):
            self.running[claimed.id] = asyncio.Event()
            task = asyncio.create_task(self._respond(claimed), name=f"background {claimed.id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _respond(self, claimed: Claimed) -> None:
        leave = self.running[claimed.id]
        run = Run(self, claimed, leave)
        try:
            await run.run()
        except Exception:
            log.exception("background response %s: its run failed", claimed.id)
        finally:
            run.writer.task.cancel()  # done already, unless this runner stops
            self.running.pop(claimed.id, None)

    def context_of(self, owner: str | None) -> RequestContext | None:
        """Its owner's key as the keys are now (None: revoked since)."""
        if owner is None or self.keys is None or not len(self.keys):
            return RequestContext()
        key = self.keys.with_id(owner)
        return RequestContext(key=key) if key is not None else None


class Run:
    """One background response (or stream) in this process: its runs, their
    events, its end."""

    def __init__(self, runner: Runner, claimed: Claimed, leave: asyncio.Event) -> None:
        self.runner = runner
        self.claimed = claimed
        self.leave = leave
        self.kind = kind_of(claimed.path)
        self.sent = [json.loads(data) for data in claimed.sent]
        self.record: Record | None = None
        self.fixed: dict[str, Any] = {}
        if claimed.record is not None:
            self.record = msgspec.json.decode(claimed.record, type=Record)
            response = self.record.response
            self.fixed = {key: response[key] for key in FIXED if key in response}
        elif self.sent and "created" in self.sent[0]:
            self.fixed = {"created": self.sent[0]["created"]}
        self.writer = Writer(runner, claimed.id, len(self.sent))
        # Why a run again cannot go on after the events sent, once it cannot.
        self.diverged = ""

    async def run(self) -> None:
        if self.sent:
            log.info(
                "background stream %s: going on after its %d events sent",
                self.claimed.id,
                len(self.sent),
            )
        context = self.runner.context_of(self.claimed.owner)
        if context is None:
            return await self.fail("The API key that made this request was revoked.", 401)
        pauses = iter(RETRY_PAUSES)
        runs = 0
        while not self.leave.is_set():
            splice = Splice(self.kind, list(self.sent), self.fixed)
            outcome = await self.once(splice, context)
            if self.diverged:
                log.warning(
                    "background stream %s: cannot go on (%s)", self.claimed.id, self.diverged
                )
                return await self.fail(
                    "The gateway running this request stopped, and running it again gave "
                    "another answer than the one already sent, which cannot be continued."
                )
            if self.writer.ended or self.writer.lost or self.leave.is_set():
                break
            status, why = outcome
            if status in (429, 503):
                pause = next(pauses, None)
                if pause is not None:
                    await self.pause(pause)
                    continue
            if status == 200 and splice.seq > 0 and runs < self.runner.max_runs:
                runs += 1
                log.info(
                    "background stream %s: its stream broke (%s); running it again",
                    self.claimed.id,
                    why,
                )
                continue
            return await self.fail(why or f"The request failed ({status}).", status)
        await self.writer.close()

    async def pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.leave.wait()

    async def once(self, splice: Splice, context: RequestContext) -> tuple[int, str]:
        """One run: (its HTTP status, why it ended without its last event)."""
        status = 0
        buffer = b""
        error_body: list[bytes] = []
        why = ""

        async def send(message: Message) -> None:
            nonlocal status, buffer, why
            if message["type"] == "http.response.start":
                status = message["status"]
                return
            if message["type"] != "http.response.body":
                return
            if status != 200:
                error_body.append(message.get("body", b""))
                return
            buffer += message.get("body", b"")
            frames, _, buffer = buffer.rpartition(b"\n\n")
            for frame in frames.split(b"\n\n"):
                for line in frame.split(b"\n"):
                    if line == b"data: [DONE]":
                        self.writer.add(None, None, "completed")
                    elif line.startswith(b"data: "):
                        why = self.event(splice, json.loads(line[6:])) or why

        await own_request(
            self.runner.app,
            self.claimed.path,
            self.claimed.request,
            self.claimed.id,
            context,
            self.leave,
            send,
        )
        if status != 200:
            return status, _message(b"".join(error_body)) or why
        return status, why or "the stream ended before its last event"

    def event(self, splice: Splice, event: dict[str, Any]) -> str:
        """Store an event of the run; why the stream broke, for an error event."""
        if self.diverged:
            return ""
        error = self.kind.error(event)
        if error is not None:
            return error
        try:
            taken = splice.take(event)
        except Diverged as exc:
            self.diverged = str(exc)
            self.leave.set()  # the run stops here: nothing of it goes out
            return ""
        if taken is None:
            return ""
        self.sent.append(taken)  # what a run again in this process repeats
        ends = self.kind.ends(taken)
        record = None
        response = taken.get("response")
        if self.record is not None and isinstance(response, dict):
            items = self.record.items
            if ends:
                items = [*items, *response.get("output", [])]
            record = msgspec.json.encode(Record(response, items))
        self.writer.add(msgspec.json.encode(taken), record, ends)
        return ""

    async def fail(self, message: str, status: int = 500) -> None:
        """End it ``failed``, with a last event saying why (OpenAI's codes for
        a response's error: the request refused, over a limit, or the
        server's fault)."""
        code = "server_error"
        if status == 429:
            code = "rate_limit_exceeded"
        elif 400 <= status < 500:
            code = "invalid_prompt"
        error = {"code": code, "message": message}
        base = self.record.response if self.record is not None else {}
        event = self.kind.failure(base, error, self.writer.next)
        record = None
        if self.record is not None:
            record = msgspec.json.encode(Record(event["response"], self.record.items))
        self.writer.add(msgspec.json.encode(event), record, "failed")
        await self.writer.close()
        log.warning("background stream %s failed: %s", self.claimed.id, message)


class Writer:
    """A response's events to the store, a batch per write, the next while one
    is under way; the last write ends it."""

    def __init__(self, runner: Runner, response_id: str, first: int) -> None:
        self.runner = runner
        self.response_id = response_id
        self.next = first  # the number of the next event added
        self.pending: list[bytes] = []
        self.record: bytes | None = None
        self.status = ""
        self.ended = False  # its last event is added
        self.lost = False  # cancelled, or another replica's now
        self.closing = False  # what is left is written, then it stops
        self.kick = asyncio.Event()
        self.task = asyncio.create_task(self._loop(), name=f"events of {response_id}")

    def add(self, event: bytes | None, record: bytes | None, status: str) -> None:
        """An event to store (None: none, only the end), the response's record
        as it now stands, and the status it ends with (``""``: it goes on)."""
        if self.ended or self.lost:
            return
        if event is not None:
            self.pending.append(event)
            self.next += 1
        if record is not None:
            self.record = record
        if status:
            self.status = status
            self.ended = True
        self.kick.set()

    async def close(self) -> None:
        """Write what is left (the last write, if it ended), then stop."""
        self.closing = True
        self.kick.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def _loop(self) -> None:
        store = self.runner.state.background
        first = self.next
        while True:
            await self.kick.wait()
            self.kick.clear()
            events, record, status = self.pending, self.record, self.status
            if events or record is not None or status:
                self.pending, self.record = [], None
                try:
                    written = await asyncio.to_thread(
                        store.append,
                        self.runner.owner,
                        self.response_id,
                        first,
                        events,
                        record,
                        status,
                    )
                except Unavailable as exc:
                    log.warning(
                        "background response %s: events not stored yet (%s)", self.response_id, exc
                    )
                    self.pending = [*events, *self.pending]
                    self.record = self.record or record
                    await asyncio.sleep(STORE_PAUSE)
                    self.kick.set()
                    continue
                if not written:
                    self.lost = True
                    self.runner.stop_one(self.response_id)
                    return
                first += len(events)
                self.runner.changed(self.response_id)
                if status:
                    return
            if self.closing and not self.pending:
                return


def _message(body: bytes) -> str:
    """An error answer's message."""
    try:
        error = json.loads(body).get("error", {})
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:200]
    return str(error.get("message", "")) if isinstance(error, dict) else ""
