"""Batch jobs: created with their lines, run by every replica (``gateway.state.lines``), ended once.

A job's lines are rows, leased to the replicas that run them. A job whose
lines are all done (or that was cancelled, or ran past its window) is ended
by one replica at a time too, under a lease on the job's row: its output and
error files are assembled from the committed rows, and their ids follow from
the job's, so ending a job again after a crash writes the same files. The
OpenAI Batch object is shaped here and nowhere else; its ``usage`` is the
sum of its answers' usage, filled in when it ends. A job and its output and
error files belong to the key that created it (``viewer`` as in
``gateway.state``).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import Connection, Select, func, insert, or_, select, update

from gateway.state.db import Database
from gateway.state.files import Files, new_id
from gateway.state.lines import Line, Lines
from gateway.state.tables import batches, lines
from gateway.state.usage import batch_usage

# A job the runners still have to take further.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
# Running, or being ended: a job whose end is still to be written.
_UNENDED = ("in_progress", "finalizing", "cancelling")
STATUSES = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)
COMPLETION_SECONDS = {"24h": 24 * 3600}


@dataclass(frozen=True)
class Ending:
    """A job that is ready to end, and how."""

    batch_id: str
    status: str  # completed, expired or cancelled


class Batches:
    def __init__(self, db: Database, files: Files, output_seconds: float) -> None:
        self.db = db
        self.files = files
        self.lines = Lines(db)
        # How long a job's output and error files are kept (0 = for ever).
        self.output_seconds = output_seconds

    # -- the jobs ----------------------------------------------------------------

    def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        rows: list[Line],
        owner: str | None = None,
    ) -> dict[str, Any]:
        """A new job in ``validating`` with its lines, all pending, in one transaction."""
        batch_id = new_id("batch_")
        now = int(time.time())
        expires = now + COMPLETION_SECONDS[completion_window]
        batch = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "model": _model_of(rows[0]) if rows else None,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": expires,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "metadata": metadata,
            # The sum of the answers' usage, once the job ends (finalize).
            "usage": None,
        }
        with self.db.write() as db:
            db.execute(
                insert(batches).values(
                    id=batch_id,
                    status="validating",
                    created_at=now,
                    expires_at=expires,
                    object=msgspec.json.encode(batch),
                    owner=owner,
                )
            )
            if rows:
                db.execute(
                    insert(lines),
                    [
                        {
                            "batch_id": batch_id,
                            "line": x.index,
                            "custom_id": x.custom_id,
                            "url": x.url,
                            "body": x.body,
                        }
                        for x in rows
                    ],
                )
            return _with_counts(db, batch)

    def get(self, batch_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        with self.db.read() as db:
            batch = _load(db, batch_id, viewer)
            return _with_counts(db, batch) if batch else None

    def page(
        self, after: str | None, limit: int, viewer: str | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """A page of jobs, newest first, and whether more follow (a cursor ``after``
        that ``viewer`` may not see: an unknown one, an empty page)."""
        query = _seen_by(select(batches.c.object), viewer)
        if after:
            cursor = _seen_by(select(batches.c.seq).where(batches.c.id == after), viewer)
            mark = cursor.scalar_subquery()
            query = query.where(batches.c.seq < mark)
        with self.db.read() as db:
            rows = list(db.scalars(query.order_by(batches.c.seq.desc()).limit(limit + 1)))
            page = [_with_counts(db, msgspec.json.decode(row)) for row in rows[:limit]]
        return page, len(rows) > limit

    def set_status(
        self,
        batch_id: str,
        status: str,
        only_from: tuple[str, ...] = (),
        viewer: str | None = None,
    ) -> dict[str, Any] | None:
        """Move the job to ``status`` (stamping ``STATUS_at``) if it is in one of
        ``only_from`` (any, if empty); the job as it is after, or None if unknown."""
        with self.db.write() as db:
            query = _seen_by(select(batches.c.object).where(batches.c.id == batch_id), viewer)
            if self.db.postgres:
                query = query.with_for_update()
            raw = db.scalar(query)
            if raw is None:
                return None
            batch: dict[str, Any] = msgspec.json.decode(raw)
            if not only_from or batch["status"] in only_from:
                _save(db, batch, status)
            return _with_counts(db, batch)

    def start_validated(self) -> list[str]:
        """Move every job in ``validating`` to ``in_progress``; their ids."""
        with self.db.read() as db:
            ids = list(db.scalars(select(batches.c.id).where(batches.c.status == "validating")))
        return [
            batch_id
            for batch_id in ids
            if (moved := self.set_status(batch_id, "in_progress", ("validating",)))
            and moved["status"] == "in_progress"
        ]

    def statuses(self, ids: list[str]) -> dict[str, str]:
        with self.db.read() as db:
            rows = db.execute(select(batches.c.id, batches.c.status).where(batches.c.id.in_(ids)))
            return {row.id: row.status for row in rows}

    def job_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        query = select(batches.c.status, func.count()).group_by(batches.c.status)
        with self.db.read() as db:
            for status, count in db.execute(query):
                counts[status] = count
        return counts

    # -- ending a job ----------------------------------------------------------------

    def ending(self) -> list[Ending]:
        """Jobs ready to end that no replica is ending: every line done; past the
        window, or cancelled, with no line under a live lease."""
        now = time.time()
        pending = (
            select(func.count())
            .where(lines.c.batch_id == batches.c.id, lines.c.state == "pending")
            .scalar_subquery()
        )
        running = (
            select(func.count())
            .where(
                lines.c.batch_id == batches.c.id,
                lines.c.state == "pending",
                lines.c.lease_until > now,
            )
            .scalar_subquery()
        )
        query = select(
            batches.c.id, batches.c.status, batches.c.expires_at, pending, running
        ).where(
            batches.c.status.in_(_UNENDED),
            or_(batches.c.lease_until.is_(None), batches.c.lease_until < now),
        )
        out = []
        with self.db.read() as db:
            for batch_id, status, expires_at, left, busy in db.execute(query):
                if status == "cancelling" and not busy:
                    out.append(Ending(batch_id, "cancelled"))
                elif not left:
                    out.append(Ending(batch_id, "completed"))
                elif expires_at <= now and not busy:
                    out.append(Ending(batch_id, "expired"))
        return out

    def take(self, batch_id: str, owner: str, lease: float) -> bool:
        """The lease on ending a job not ended yet, if no live one is held; whether
        this replica has it. (A replica that listed the job as ending before
        another ended it finds it ended: it is not ended twice.)"""
        now = time.time()
        with self.db.write() as db:
            return (
                db.execute(
                    update(batches)
                    .where(
                        batches.c.id == batch_id,
                        batches.c.status.in_(_UNENDED),
                        or_(batches.c.lease_until.is_(None), batches.c.lease_until < now),
                    )
                    .values(lease_owner=owner, lease_until=now + lease)
                ).rowcount
                == 1
            )

    def finalize(
        self, batch_id: str, status: str, unrun_code: str, unrun_message: str
    ) -> tuple[dict[str, Any], int]:
        """End the job in ``status``: its output file (answers, in input order) and
        error file (error answers, and ``unrun_code`` errors for lines never run),
        written from the lines' rows. Safe to repeat (file ids follow from the
        job's). Returns the job and how many lines never ran."""
        if status == "completed":
            self.set_status(batch_id, "finalizing", ("in_progress",))
        with self.db.read() as db:
            rows = db.execute(
                select(lines.c.custom_id, lines.c.state, lines.c.result)
                .where(lines.c.batch_id == batch_id)
                .order_by(lines.c.line)
            ).all()
            owner = db.scalar(select(batches.c.owner).where(batches.c.id == batch_id))
        output, failed = [], []
        unrun = 0
        for custom_id, state, result in rows:
            if state == "completed":
                output.append(result)
            elif state == "failed":
                failed.append(result)
            else:
                unrun += 1
                failed.append(msgspec.json.encode(error_line(custom_id, unrun_code, unrun_message)))
        expires = int(time.time() + self.output_seconds) if self.output_seconds else None
        output_id = derived_id(batch_id, "output")
        self.files.add(
            _jsonl(output), f"{batch_id}_output.jsonl", "batch_output", output_id, expires, owner
        )
        error_id = None
        if failed:
            error_id = derived_id(batch_id, "error")
            self.files.add(
                _jsonl(failed), f"{batch_id}_error.jsonl", "batch_output", error_id, expires, owner
            )
        with self.db.write() as db:
            stored = _load(db, batch_id)
            assert stored is not None
            stored["output_file_id"] = output_id
            stored["error_file_id"] = error_id
            stored["usage"] = batch_usage(output)
            _save(db, stored, status)
            db.execute(
                update(batches)
                .where(batches.c.id == batch_id)
                .values(lease_owner=None, lease_until=None)
            )
            return _with_counts(db, stored), unrun


def output_line(custom_id: str, status_code: int, request_id: str, body: Any) -> dict[str, Any]:
    """A line of the output (200) or error file (an error status): OpenAI's shape."""
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line of the error file for a request that got no HTTP answer (never ran)."""
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def derived_id(batch_id: str, kind: str) -> str:
    """A file id that is the same every time this batch's ``kind`` file is written."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def _seen_by(query: Select[Any], viewer: str | None) -> Select[Any]:
    """``query`` limited to the jobs ``viewer`` may see (None: every job)."""
    return query if viewer is None else query.where(batches.c.owner == viewer)


def _load(db: Connection, batch_id: str, viewer: str | None = None) -> dict[str, Any] | None:
    raw = db.scalar(_seen_by(select(batches.c.object).where(batches.c.id == batch_id), viewer))
    if raw is None:
        return None
    batch: dict[str, Any] = msgspec.json.decode(raw)
    return batch


def _save(db: Connection, batch: dict[str, Any], status: str) -> None:
    if batch["status"] != status:
        batch["status"] = status
        batch[f"{status}_at"] = int(time.time())
    db.execute(
        update(batches)
        .where(batches.c.id == batch["id"])
        .values(status=status, object=msgspec.json.encode(batch))
    )


def _with_counts(db: Connection, batch: dict[str, Any]) -> dict[str, Any]:
    counts = {"pending": 0, "completed": 0, "failed": 0}
    query = (
        select(lines.c.state, func.count())
        .where(lines.c.batch_id == batch["id"])
        .group_by(lines.c.state)
    )
    for state, count in db.execute(query):
        counts[state] = count
    return {
        **batch,
        "request_counts": {
            "total": sum(counts.values()),
            "completed": counts["completed"],
            "failed": counts["failed"],
        },
    }


def _jsonl(rows: list[bytes]) -> bytes:
    return b"".join(row + b"\n" for row in rows)


def _model_of(line: Line) -> str | None:
    model = msgspec.json.decode(line.body).get("model")
    return model if isinstance(model, str) else None
