"""Uploaded files and the batches' output files: rows, with their bytes in chunks.

The OpenAI File object is shaped here and nowhere else. A file may carry an
expiry (``expires_after`` at upload, a batch's outputs after
``--batch-output-days``); ``expire()`` deletes what is past it, rows and
bytes, so the space is reclaimed (any replica may run it: deleting twice is
deleting once). A file belongs to the key that uploaded it (a batch's
output and error files to the batch's): ``viewer`` as in ``gateway.state``.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from sqlalchemy import Connection, Select, delete, func, insert, select

from gateway.state.db import Database
from gateway.state.tables import CHUNK_BYTES, file_chunks, files

# The purposes a client uploads a file for (the gateway writes the others:
# a batch's output and error files).
UPLOADED = ("batch",)

# Expired files deleted in one transaction.
EXPIRE_AT_ONCE = 500


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class Files:
    def __init__(self, db: Database) -> None:
        self.db = db

    def add(
        self,
        data: bytes,
        filename: str,
        purpose: str,
        file_id: str = "",
        expires_at: int | None = None,
        owner: str | None = None,
    ) -> dict[str, Any]:
        """Store a file (replacing one of the same id: writing a batch's output again)."""
        file_id = file_id or new_id("file-")
        created = int(time.time())
        row = {
            "id": file_id,
            "purpose": purpose,
            "filename": filename,
            "bytes": len(data),
            "created_at": created,
            "expires_at": expires_at,
        }
        with self.db.write() as db:
            _delete(db, [file_id])
            db.execute(insert(files).values({**row, "owner": owner}))
            chunks = [
                {"file_id": file_id, "n": n, "data": data[at : at + CHUNK_BYTES]}
                for n, at in enumerate(range(0, len(data), CHUNK_BYTES))
            ]
            if chunks:
                db.execute(insert(file_chunks), chunks)
        return file_object(row)

    def get(self, file_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        query = _seen_by(select(files).where(files.c.id == file_id), viewer)
        with self.db.read() as db:
            row = db.execute(query).mappings().first()
        return file_object(row) if row else None

    def content(self, file_id: str, viewer: str | None = None) -> bytes | None:
        query = _seen_by(select(files.c.id).where(files.c.id == file_id), viewer)
        with self.db.read() as db:
            if db.scalar(query) is None:
                return None
            parts = db.scalars(
                select(file_chunks.c.data)
                .where(file_chunks.c.file_id == file_id)
                .order_by(file_chunks.c.n)
            )
            return b"".join(parts)

    def page(
        self,
        purpose: str | None,
        after: str | None,
        limit: int,
        ascending: bool,
        viewer: str | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:
        """A page of files and whether more follow, newest first unless ``ascending``.
        A cursor ``after`` that ``viewer`` may not see is an unknown one (an empty
        page), never a place in another key's files."""
        query = _seen_by(select(files), viewer)
        if purpose:
            query = query.where(files.c.purpose == purpose)
        if after:
            cursor = _seen_by(select(files.c.seq).where(files.c.id == after), viewer)
            mark = cursor.scalar_subquery()
            query = query.where(files.c.seq > mark if ascending else files.c.seq < mark)
        order = files.c.seq.asc() if ascending else files.c.seq.desc()
        with self.db.read() as db:
            rows = db.execute(query.order_by(order).limit(limit + 1)).mappings().all()
        return [file_object(row) for row in rows[:limit]], len(rows) > limit

    def delete(self, file_id: str, viewer: str | None = None) -> bool:
        with self.db.write() as db:
            if db.scalar(_seen_by(select(files.c.id).where(files.c.id == file_id), viewer)):
                return _delete(db, [file_id]) > 0
            return False

    def expire(self, now: float | None = None) -> int:
        """Delete the files past their expiry, ``EXPIRE_AT_ONCE`` to a transaction
        (a backlog of any size: no query names more ids than a database takes,
        and no transaction holds the store for long); how many."""
        now = time.time() if now is None else now
        expired = (
            select(files.c.id)
            .where(files.c.expires_at.is_not(None), files.c.expires_at <= now)
            .limit(EXPIRE_AT_ONCE)
        )
        deleted = 0
        while True:
            with self.db.write() as db:
                gone = list(db.scalars(expired))
                deleted += _delete(db, gone) if gone else 0
            if len(gone) < EXPIRE_AT_ONCE:
                return deleted

    def uploaded_bytes(self, owner: str | None) -> int:
        """The bytes of the files ``owner`` uploaded and still keeps (not the
        batches' output files, which the gateway wrote)."""
        query = select(func.coalesce(func.sum(files.c.bytes), 0)).where(
            files.c.owner == owner, files.c.purpose.in_(UPLOADED)
        )
        with self.db.read() as db:
            return int(db.scalar(query) or 0)

    def total_bytes(self) -> int:
        with self.db.read() as db:
            return int(db.scalar(select(func.coalesce(func.sum(files.c.bytes), 0))) or 0)


def _seen_by(query: Select[Any], viewer: str | None) -> Select[Any]:
    """``query`` limited to the files ``viewer`` may see (None: every file)."""
    return query if viewer is None else query.where(files.c.owner == viewer)


def _delete(db: Connection, ids: list[str]) -> int:
    db.execute(delete(file_chunks).where(file_chunks.c.file_id.in_(ids)))
    return db.execute(delete(files).where(files.c.id.in_(ids))).rowcount


def file_object(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": row["expires_at"],
    }
