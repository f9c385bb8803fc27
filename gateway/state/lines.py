"""A batch job's lines, leased to the replicas that run them.

A replica *claims* a few pending lines at a time (a lease: its name and a
deadline it renews while it runs them), so N replicas run a big job on N
gateways' admission queues, and a replica that dies leaves leases that lapse
and are claimed again. Only the holder of a live lease may commit a line's
result, once (``state = 'pending'`` in the same statement): a line run twice
(its replica stalled past the lease) still has exactly one result.

PostgreSQL: claims lock the rows they take (``FOR UPDATE SKIP LOCKED``), so
replicas claiming at once take different lines; SQLite: write transactions
take turns. Lease times are the replicas' clocks (keep them in NTP sync).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import and_, or_, select, update

from gateway.state.db import Database
from gateway.state.tables import batches, lines

# Precompute: a job created with this metadata fills the response cache.
CACHE_METADATA_KEY = "llmgate_cache"


@dataclass(frozen=True)
class Line:
    """One request of a batch: its position (0-based, in the file's order), id, route and body."""

    index: int
    custom_id: str
    url: str
    body: bytes


@dataclass(frozen=True)
class Claimed:
    """A line this replica holds a lease on, with what running it needs of its job."""

    batch_id: str
    line: Line
    cache: bool
    expires_at: int
    # The id of the API key that created the job (None: no keys then).
    owner: str | None = None


class Lines:
    def __init__(self, db: Database) -> None:
        self.db = db

    def claim(self, owner: str, most: int, lease: float) -> list[Claimed]:
        """Lease up to ``most`` pending lines no live lease holds, oldest job first."""
        now = time.time()
        free = or_(lines.c.lease_until.is_(None), lines.c.lease_until < now)
        query = (
            select(lines.c.batch_id, lines.c.line)
            .join(batches, batches.c.id == lines.c.batch_id)
            .where(
                batches.c.status == "in_progress",
                batches.c.expires_at > now,
                lines.c.state == "pending",
                free,
            )
            .order_by(batches.c.seq, lines.c.line)
            .limit(most)
        )
        if self.db.postgres:
            query = query.with_for_update(of=lines, skip_locked=True)
        with self.db.write() as db:
            taken: dict[str, list[int]] = {}
            for batch_id, index in db.execute(query):
                taken.setdefault(batch_id, []).append(index)
            claimed: list[Claimed] = []
            for batch_id, indices in taken.items():
                db.execute(
                    update(lines)
                    .where(lines.c.batch_id == batch_id, lines.c.line.in_(indices))
                    .values(lease_owner=owner, lease_until=now + lease)
                )
                raw, job_owner = db.execute(
                    select(batches.c.object, batches.c.owner).where(batches.c.id == batch_id)
                ).one()
                job = msgspec.json.decode(raw)
                cache = (job.get("metadata") or {}).get(CACHE_METADATA_KEY) == "true"
                rows = db.execute(
                    select(lines.c.line, lines.c.custom_id, lines.c.url, lines.c.body)
                    .where(lines.c.batch_id == batch_id, lines.c.line.in_(indices))
                    .order_by(lines.c.line)
                )
                claimed += [
                    Claimed(batch_id, Line(*row), cache, job["expires_at"], job_owner)
                    for row in rows
                ]
            return claimed

    def renew(self, owner: str, lease: float, running: Iterable[tuple[str, int]]) -> int:
        """Extend ``owner``'s leases on the pending lines it still runs (batch id,
        line); how many. Only those: a line it gave up on without being able to
        say so (the store was down) lapses to another replica."""
        by_batch: dict[str, list[int]] = {}
        for batch_id, index in running:
            by_batch.setdefault(batch_id, []).append(index)
        if not by_batch:
            return 0
        which = or_(
            *(
                and_(lines.c.batch_id == batch_id, lines.c.line.in_(indices))
                for batch_id, indices in by_batch.items()
            )
        )
        with self.db.write() as db:
            return db.execute(
                update(lines)
                .where(lines.c.lease_owner == owner, lines.c.state == "pending", which)
                .values(lease_until=time.time() + lease)
            ).rowcount

    def release(self, owner: str, batch_id: str, index: int) -> None:
        """Give a line back unrun (its job was cancelled, or this replica stops)."""
        with self.db.write() as db:
            db.execute(
                update(lines)
                .where(_held(owner, batch_id, index), lines.c.state == "pending")
                .values(lease_owner=None, lease_until=None)
            )

    def release_all(self, owner: str) -> int:
        """Give back every line ``owner`` holds (the runner stops); how many."""
        with self.db.write() as db:
            return db.execute(
                update(lines)
                .where(lines.c.lease_owner == owner, lines.c.state == "pending")
                .values(lease_owner=None, lease_until=None)
            ).rowcount

    def finish_line(
        self, owner: str, batch_id: str, index: int, failed: bool, result: dict[str, Any]
    ) -> bool:
        """Commit a line's result, if ``owner`` still holds it: from now on it is
        done, whatever happens to any gateway. Whether it was. A lease that
        lapsed with no other replica taking the line still holds it: the answer
        is kept rather than run again; once another took it, it is the other's."""
        with self.db.write() as db:
            return (
                db.execute(
                    update(lines)
                    .where(_held(owner, batch_id, index), lines.c.state == "pending")
                    .values(
                        state="failed" if failed else "completed",
                        result=msgspec.json.encode(result),
                        done_by=owner,
                        lease_owner=None,
                        lease_until=None,
                    )
                ).rowcount
                == 1
            )


def _held(owner: str, batch_id: str, index: int) -> Any:
    return and_(lines.c.batch_id == batch_id, lines.c.line == index, lines.c.lease_owner == owner)
