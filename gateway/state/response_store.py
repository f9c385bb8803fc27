"""Stored responses (the Responses API's ``store``), kept for a stated retention.

Not a cache: a stored response stays until its retention ends (30 days by
default, as OpenAI keeps them; ``--responses-days``), whatever else the
gateway stores, and every replica sharing the store finds it.
``expire()`` deletes what is past its retention. A response belongs to the
key that made it: another key finds none (``viewer`` as in ``gateway.state``),
and may not take its id: a ``put`` of an id that a live response of another
``owner`` holds raises ``IdTaken`` and changes nothing (a client chooses its
response's id with vLLM's ``request_id``).
"""

from __future__ import annotations

import time

from sqlalchemy import Connection, delete, or_, select
from sqlalchemy.dialects import postgresql, sqlite

from gateway.state.db import Database
from gateway.state.tables import responses


class IdTaken(Exception):
    """The response id is another owner's (a live response holds it)."""


class Responses:
    def __init__(self, db: Database, retention_seconds: float) -> None:
        self.db = db
        self.retention_seconds = retention_seconds

    def put(self, response_id: str, record: bytes, owner: str | None = None) -> None:
        """Store a response under ``response_id`` (replacing its owner's own, or
        an expired one); ``IdTaken`` if a live response of another owner has it."""
        with self.db.write() as db:
            if not self.put_in(db, response_id, record, owner):
                raise IdTaken(response_id)

    def put_in(self, db: Connection, response_id: str, record: bytes, owner: str | None) -> bool:
        """``put`` inside the transaction ``db``; False if the id is another's."""
        now = int(time.time())
        dialect = postgresql if self.db.postgres else sqlite
        row = {
            "id": response_id,
            "created_at": now,
            "expires_at": now + int(self.retention_seconds),
            "record": record,
            "owner": owner,
        }
        upsert = dialect.insert(responses).values(row)
        # One statement, so two owners putting one id at once cannot both win:
        # the row is replaced only where it is the same owner's, or expired.
        upsert = upsert.on_conflict_do_update(
            index_elements=["id"],
            set_={name: upsert.excluded[name] for name in row if name != "id"},
            where=or_(
                responses.c.owner.is_not_distinct_from(upsert.excluded.owner),
                responses.c.expires_at <= now,
            ),
        ).returning(responses.c.id)
        return db.execute(upsert).first() is not None

    def taken(self, response_id: str, owner: str | None) -> bool:
        """Whether a live response of another owner than ``owner`` has this id."""
        query = select(responses.c.id).where(
            responses.c.id == response_id,
            responses.c.expires_at > time.time(),
            responses.c.owner.is_distinct_from(owner),
        )
        with self.db.read() as db:
            return db.scalar(query) is not None

    def get(self, response_id: str, viewer: str | None = None) -> bytes | None:
        query = select(responses.c.record).where(
            responses.c.id == response_id, responses.c.expires_at > time.time()
        )
        if viewer is not None:
            query = query.where(responses.c.owner == viewer)
        with self.db.read() as db:
            record: bytes | None = db.scalar(query)
            return record

    def expire(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        with self.db.write() as db:
            return db.execute(delete(responses).where(responses.c.expires_at <= now)).rowcount
