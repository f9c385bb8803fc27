"""Background responses (``background: true``): their requests, leases and stream events.

A background response is created ``queued`` with its stored response (in
``responses``, so ``GET`` finds it at once). A replica *claims* it (a lease
it renews while it runs it: ``in_progress``) and *appends* its stream's
events, numbered from 0, while it still holds the lease and the response is
still in progress: one statement decides, so a cancelled response or one
another replica took over gets no more events from this one. The append of
the last events ends the response (its status and its stored response in the
same transaction). A replica that dies leaves a lease that lapses; another
claims the response and gets the events already stored, to go on after them.
Readers (``events``) get the events after a sequence number and the status
read in the same transaction: an ended status means no event will follow.
On PostgreSQL, ``notify`` tells every replica's listener which responses
have new events or ended (``gateway.background.listen``).
Owners as everywhere in ``gateway.state``: a viewer sees its own only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import ColumnElement, Select, and_, delete, insert, or_, select, text, update

from gateway.state.db import Database
from gateway.state.response_store import IdTaken, Responses
from gateway.state.tables import background, response_events, responses
from shared import routes

OPEN = ("queued", "in_progress")
ENDED = frozenset({"completed", "incomplete", "failed", "cancelled"})


RESPONSES_PATH = routes.RESPONSES.path
# PostgreSQL's notification channel for "events stored", the payload a response's id.
CHANNEL = "llmgate_background"
_NOTIFY = text("SELECT pg_notify(:channel, id) FROM unnest(CAST(:ids AS text[])) AS id")


@dataclass(frozen=True)
class Claimed:
    """A background response (or stream) this replica now runs."""

    id: str
    owner: str | None
    # The route it runs on.
    path: str
    request: bytes
    # Its stored response (``gateway.api.responses.Record`` as JSON); None
    # for a chat or completion stream, which has none.
    record: bytes | None
    # The events already stored, in order (a takeover goes on after them).
    sent: list[bytes]


class Background:
    def __init__(self, db: Database, store: Responses, retention_seconds: float) -> None:
        self.db = db
        self.responses = store
        # How long a background response's events are kept for resuming.
        self.retention_seconds = retention_seconds

    def create(
        self,
        response_id: str,
        owner: str | None,
        request: bytes,
        record: bytes | None,
        path: str = RESPONSES_PATH,
    ) -> None:
        """A queued background response (with its stored ``record``), or a
        stream of ``path`` (without); ``IdTaken`` if the id is in use (any
        owner's background response, or another owner's stored response)."""
        now = int(time.time())
        with self.db.write() as db:
            taken = db.scalar(select(background.c.id).where(background.c.id == response_id))
            if taken is not None:
                raise IdTaken(response_id)
            if record is not None and not self.responses.put_in(db, response_id, record, owner):
                raise IdTaken(response_id)
            db.execute(
                insert(background).values(
                    id=response_id,
                    owner=owner,
                    created_at=now,
                    expires_at=now + int(self.retention_seconds),
                    request=request,
                    status="queued",
                    path=path,
                )
            )

    def claim(self, runner: str, most: int, lease: float) -> list[Claimed]:
        """Lease up to ``most`` open background responses no live lease holds, oldest first."""
        now = time.time()
        query = (
            select(background.c.id)
            .where(
                background.c.status.in_(OPEN),
                or_(background.c.lease_until.is_(None), background.c.lease_until < now),
            )
            .order_by(background.c.created_at)
            .limit(most)
        )
        if self.db.postgres:
            query = query.with_for_update(skip_locked=True)
        with self.db.write() as db:
            ids = list(db.scalars(query))
            if not ids:
                return []
            db.execute(
                update(background)
                .where(background.c.id.in_(ids))
                .values(status="in_progress", lease_owner=runner, lease_until=now + lease)
            )
            rows = db.execute(
                select(
                    background.c.id,
                    background.c.owner,
                    background.c.path,
                    background.c.request,
                    responses.c.record,
                )
                .outerjoin(responses, responses.c.id == background.c.id)
                .where(background.c.id.in_(ids))
                .order_by(background.c.created_at)
            ).all()
            claimed = []
            for response_id, owner, path, request, record in rows:
                sent = db.scalars(
                    select(response_events.c.data)
                    .where(response_events.c.response_id == response_id)
                    .order_by(response_events.c.seq)
                )
                claimed.append(Claimed(response_id, owner, path, request, record, list(sent)))
            return claimed

    def renew(self, runner: str, lease: float, ids: Iterable[str]) -> set[str]:
        """Extend ``runner``'s leases on ``ids``; those it still holds in progress
        (the others were cancelled, or taken over after a lapse)."""
        wanted = list(ids)
        if not wanted:
            return set()
        held = _held(runner, wanted)
        with self.db.write() as db:
            db.execute(update(background).where(held).values(lease_until=time.time() + lease))
            return set(db.scalars(select(background.c.id).where(held)))

    def append(
        self,
        runner: str,
        response_id: str,
        first: int,
        events: list[bytes],
        record: bytes | None = None,
        status: str = "",
    ) -> bool:
        """Store ``events`` as numbers ``first``, ``first + 1``, ...; and, given,
        the response's stored record and its final ``status`` (then the lease
        ends). Only while ``runner`` holds it in progress: whether it did."""
        with self.db.write() as db:
            changes: dict[str, object] = {"status": status} if status else {}
            if status:
                changes.update(lease_owner=None, lease_until=None)
            guard = update(background).where(_held(runner, [response_id]))
            if db.execute(guard.values(**changes or {"lease_owner": runner})).rowcount != 1:
                return False
            if events:
                db.execute(
                    insert(response_events),
                    [
                        {"response_id": response_id, "seq": first + i, "data": data}
                        for i, data in enumerate(events)
                    ],
                )
            if record is not None:
                db.execute(
                    update(responses).where(responses.c.id == response_id).values(record=record)
                )
            return True

    def events(
        self,
        response_id: str,
        after: int,
        viewer: str | None,
        path: str = RESPONSES_PATH,
        most: int = 1000,
    ) -> tuple[str, list[tuple[int, bytes]]] | None:
        """The status and the events numbered above ``after`` (at most ``most``);
        None if ``viewer`` has no such background response (of ``path``)."""
        query = _mine(response_id, viewer, path)
        with self.db.read() as db:
            status = db.scalar(query)
            if status is None:
                return None
            rows = db.execute(
                select(response_events.c.seq, response_events.c.data)
                .where(response_events.c.response_id == response_id, response_events.c.seq > after)
                .order_by(response_events.c.seq)
                .limit(most)
            ).all()
            return status, [(seq, data) for seq, data in rows]

    def status(
        self, response_id: str, viewer: str | None, path: str = RESPONSES_PATH
    ) -> str | None:
        query = _mine(response_id, viewer, path)
        with self.db.read() as db:
            found: str | None = db.scalar(query)
            return found

    def cancel(self, response_id: str, viewer: str | None) -> tuple[str, bytes] | None:
        """Cancel it if it is still open: (its status before, its stored record
        now); None if ``viewer`` has no such background response."""
        query = _mine(response_id, viewer, RESPONSES_PATH)
        if self.db.postgres:
            query = query.with_for_update()
        with self.db.write() as db:
            before = db.scalar(query)
            if before is None:
                return None
            record = db.scalar(select(responses.c.record).where(responses.c.id == response_id))
            if record is None:
                return None
            if before in OPEN:
                db.execute(
                    update(background)
                    .where(background.c.id == response_id)
                    .values(status="cancelled", lease_owner=None, lease_until=None)
                )
                stored = msgspec.json.decode(record)
                stored["response"]["status"] = "cancelled"
                record = msgspec.json.encode(stored)
                db.execute(
                    update(responses).where(responses.c.id == response_id).values(record=record)
                )
            return before, record

    def notify(self, response_ids: Iterable[str]) -> None:
        """On PostgreSQL: notify ``CHANNEL`` once for each of ``response_ids``, in one
        transaction of its own. Not in each append's: PostgreSQL serializes the
        commits of the transactions that notify, cluster-wide."""
        ids = list(response_ids)
        if not self.db.postgres or not ids:
            return
        with self.db.write() as db:
            db.execute(_NOTIFY, {"channel": CHANNEL, "ids": ids})

    def release_all(self, runner: str) -> int:
        """Give back the leases ``runner`` holds (it stops): another replica goes on."""
        with self.db.write() as db:
            return db.execute(
                update(background)
                .where(background.c.lease_owner == runner, background.c.status.in_(OPEN))
                .values(lease_until=None)
            ).rowcount

    def expire(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        with self.db.write() as db:
            gone = select(background.c.id).where(background.c.expires_at <= now)
            db.execute(delete(response_events).where(response_events.c.response_id.in_(gone)))
            return db.execute(delete(background).where(background.c.expires_at <= now)).rowcount


def _mine(response_id: str, viewer: str | None, path: str) -> Select[Any]:
    """Its status, if ``viewer`` may see it and it runs on ``path``."""
    query = select(background.c.status).where(
        background.c.id == response_id, background.c.path == path
    )
    return query if viewer is None else query.where(background.c.owner == viewer)


def _held(runner: str, ids: list[str]) -> ColumnElement[bool]:
    return and_(
        background.c.id.in_(ids),
        background.c.lease_owner == runner,
        background.c.status == "in_progress",
    )
