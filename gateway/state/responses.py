"""Stored responses (the Responses API's ``store``), kept for a stated retention.

Not a cache: a stored response stays until its retention ends (30 days by
default, as OpenAI keeps them; ``--responses-days``), whatever else the
gateway stores, and every replica sharing the store finds it.
``expire()`` deletes what is past its retention. A response belongs to the
key that made it: another key finds none (``viewer`` as in ``gateway.state``).
"""

from __future__ import annotations

import time

from sqlalchemy import delete, insert, select

from gateway.state.db import Database
from gateway.state.schema import responses


class Responses:
    def __init__(self, db: Database, retention_seconds: float) -> None:
        self.db = db
        self.retention_seconds = retention_seconds

    def put(self, response_id: str, record: bytes, owner: str | None = None) -> None:
        now = int(time.time())
        with self.db.write() as db:
            db.execute(delete(responses).where(responses.c.id == response_id))
            db.execute(
                insert(responses).values(
                    id=response_id,
                    created_at=now,
                    expires_at=now + int(self.retention_seconds),
                    record=record,
                    owner=owner,
                )
            )

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
