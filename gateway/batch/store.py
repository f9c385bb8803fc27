"""Files and batch jobs on disk: one SQLite database in the state directory, and the files' bytes.

Everything a job needs survives the gateway: the uploaded files
(``files/ID`` beside the database), each batch, and each of its lines with
its status and, once it has run, its result line. A line counts as done only
once that result is committed, and the output and error files are assembled
from those rows when the job ends, so a gateway killed mid-job runs its
in-flight lines again on restart and no line is lost or answered twice.

SQLite in WAL mode: the gateway's processes (``--processes N``) share it,
readers never wait for the writer, and a commit is one append to the log.
Each method is one short transaction; callers run them in a thread
(``asyncio.to_thread``), never on the event loop. The OpenAI objects (File,
Batch, output lines) are shaped here and nowhere else.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from gateway.batch.jsonl import Line

# A job the runner still has to take further (gateway.batch.runner).
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
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

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    -- The OpenAI Batch object but for request_counts (counted from lines).
    object TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    url TEXT NOT NULL,
    body BLOB NOT NULL,
    -- pending, then completed (an answer) or failed (an error answer)
    state TEXT NOT NULL DEFAULT 'pending',
    -- The output or error file's line, once run.
    result BLOB,
    PRIMARY KEY (batch_id, line)
);
"""


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class Store:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files_dir = directory / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            directory / "batches.sqlite3",
            isolation_level=None,  # transactions are explicit (_write)
            check_same_thread=False,  # one connection, used under _lock
            timeout=30.0,  # another gateway process's write in progress
        )
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            # In WAL mode NORMAL loses nothing when a process dies; only a
            # power cut may lose the last commits.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, *args: Any) -> list[Any]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- files ---------------------------------------------------------------

    def add_file(
        self, data: bytes, filename: str, purpose: str, file_id: str = ""
    ) -> dict[str, Any]:
        file_id = file_id or new_id("file-")
        path = self.files_dir / file_id
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        os.replace(partial, path)
        created = int(time.time())
        with self._write() as db:
            db.execute(
                "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)",
                (file_id, purpose, filename, len(data), created),
            )
        return _file_object(file_id, purpose, filename, len(data), created)

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        rows = self._read("SELECT * FROM files WHERE id = ?", file_id)
        return _file_object(*rows[0]) if rows else None

    def file_content(self, file_id: str) -> bytes | None:
        if self.get_file(file_id) is None:
            return None
        return (self.files_dir / file_id).read_bytes()

    def list_files(
        self, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> tuple[list[dict[str, Any]], bool]:
        """A page of files and whether more follow, newest first unless ``ascending``."""
        where, args = ["1"], []
        if purpose:
            where.append("purpose = ?")
            args.append(purpose)
        rows = self._page(
            "files",
            "id, purpose, filename, bytes, created_at",
            where,
            args,
            after,
            limit,
            ascending,
        )
        return [_file_object(*row) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        with self._write() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        if deleted:
            (self.files_dir / file_id).unlink(missing_ok=True)
        return bool(deleted)

    def _page(
        self,
        table: str,
        columns: str,
        where: list[str],
        args: list[Any],
        after: str | None,
        limit: int,
        ascending: bool,
    ) -> list[Any]:
        """Rows of ``table`` in creation order (rowid), the page after the row ``after``
        (one more than ``limit``, to tell whether more follow)."""
        order = "ASC" if ascending else "DESC"
        if after:
            where = [
                *where,
                f"rowid {'>' if ascending else '<'} (SELECT rowid FROM {table} WHERE id = ?)",
            ]
            args = [*args, after]
        sql = (
            f"SELECT {columns} FROM {table} WHERE {' AND '.join(where)} "
            f"ORDER BY rowid {order} LIMIT ?"
        )
        return self._read(sql, *args, limit + 1)

    # -- batches -------------------------------------------------------------

    def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        lines: list[Line],
    ) -> dict[str, Any]:
        """A new job in ``validating`` with its lines, all pending, in one transaction."""
        batch_id = new_id("batch_")
        now = int(time.time())
        model = _model_of(lines[0]) if lines else None
        batch = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "model": model,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + COMPLETION_SECONDS[completion_window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "metadata": metadata,
        }
        with self._write() as db:
            db.execute(
                "INSERT INTO batches VALUES (?, ?, ?, ?)",
                (batch_id, "validating", now, msgspec.json.encode(batch)),
            )
            db.executemany(
                "INSERT INTO lines (batch_id, line, custom_id, url, body) VALUES (?, ?, ?, ?, ?)",
                [(batch_id, x.index, x.custom_id, x.url, x.body) for x in lines],
            )
        return self._with_counts(batch)

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        rows = self._read("SELECT object FROM batches WHERE id = ?", batch_id)
        return self._with_counts(msgspec.json.decode(rows[0][0])) if rows else None

    def list_batches(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """A page of batches, newest first, and whether more follow."""
        rows = self._page("batches", "object", ["1"], [], after, limit, ascending=False)
        page = [self._with_counts(msgspec.json.decode(row[0])) for row in rows[:limit]]
        return page, len(rows) > limit

    def set_status(
        self, batch_id: str, status: str, only_from: tuple[str, ...] = ()
    ) -> dict[str, Any] | None:
        """Move the job to ``status`` (stamping ``STATUS_at``), if it is in one of
        ``only_from`` (any, if empty); the job as it is after, or None if unknown."""
        with self._write() as db:
            batch = _load(db, batch_id)
            if batch is None:
                return None
            if not only_from or batch["status"] in only_from:
                _save(db, batch, status)
        return self._with_counts(batch)

    def active_batches(self) -> list[tuple[str, str]]:
        """(id, status) of the jobs the runner has to take further, oldest first."""
        marks = ",".join("?" * len(ACTIVE))
        sql = f"SELECT id, status FROM batches WHERE status IN ({marks}) ORDER BY rowid"
        return [(row[0], row[1]) for row in self._read(sql, *ACTIVE)]

    def job_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for status, count in self._read("SELECT status, count(*) FROM batches GROUP BY status"):
            counts[status] = count
        return counts

    def _with_counts(self, batch: dict[str, Any]) -> dict[str, Any]:
        counts = {"pending": 0, "completed": 0, "failed": 0}
        sql = "SELECT state, count(*) FROM lines WHERE batch_id = ? GROUP BY state"
        for state, count in self._read(sql, batch["id"]):
            counts[state] = count
        total = sum(counts.values())
        return {
            **batch,
            "request_counts": {
                "total": total,
                "completed": counts["completed"],
                "failed": counts["failed"],
            },
        }

    # -- lines ---------------------------------------------------------------

    def pending_lines(self, batch_id: str) -> list[Line]:
        sql = (
            "SELECT line, custom_id, url, body FROM lines "
            "WHERE batch_id = ? AND state = 'pending' ORDER BY line"
        )
        return [Line(*row) for row in self._read(sql, batch_id)]

    def finish_line(self, batch_id: str, index: int, failed: bool, result: dict[str, Any]) -> None:
        """Commit a line's result: from now on it is done, whatever happens to the gateway."""
        with self._write() as db:
            db.execute(
                "UPDATE lines SET state = ?, result = ? "
                "WHERE batch_id = ? AND line = ? AND state = 'pending'",
                ("failed" if failed else "completed", msgspec.json.encode(result), batch_id, index),
            )

    def finalize(
        self, batch_id: str, status: str, unrun_code: str, unrun_message: str
    ) -> tuple[dict[str, Any], int]:
        """End the job in ``status``: its output file (answers, in input order) and
        error file (error answers, and ``unrun_code`` errors for lines never run),
        written from the lines' rows. Safe to repeat (file ids follow from the
        batch's). Returns the job and how many lines never ran."""
        rows = self._read(
            "SELECT line, custom_id, state, result FROM lines WHERE batch_id = ? ORDER BY line",
            batch_id,
        )
        output, failed = [], []
        unrun = 0
        for _line, custom_id, state, result in rows:
            if state == "completed":
                output.append(result)
            elif state == "failed":
                failed.append(result)
            else:
                unrun += 1
                failed.append(msgspec.json.encode(error_line(custom_id, unrun_code, unrun_message)))
        batch = self.get_batch(batch_id)
        assert batch is not None
        output_id = _derived_id(batch_id, "output")
        self.add_file(_jsonl(output), f"{batch_id}_output.jsonl", "batch_output", output_id)
        error_id = None
        if failed:
            error_id = _derived_id(batch_id, "error")
            self.add_file(_jsonl(failed), f"{batch_id}_error.jsonl", "batch_output", error_id)
        with self._write() as db:
            stored = _load(db, batch_id)
            assert stored is not None
            stored["output_file_id"] = output_id
            stored["error_file_id"] = error_id
            _save(db, stored, status)
        return self._with_counts(stored), unrun


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


def _file_object(
    file_id: str, purpose: str, filename: str, size: int, created_at: int
) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def _load(db: sqlite3.Connection, batch_id: str) -> dict[str, Any] | None:
    row = db.execute("SELECT object FROM batches WHERE id = ?", (batch_id,)).fetchone()
    if row is None:
        return None
    batch: dict[str, Any] = msgspec.json.decode(row[0])
    return batch


def _save(db: sqlite3.Connection, batch: dict[str, Any], status: str) -> None:
    if batch["status"] != status:
        batch["status"] = status
        batch[f"{status}_at"] = int(time.time())
    db.execute(
        "UPDATE batches SET status = ?, object = ? WHERE id = ?",
        (status, msgspec.json.encode(batch), batch["id"]),
    )


def _derived_id(batch_id: str, kind: str) -> str:
    """A file id that is the same every time this batch's ``kind`` file is written."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def _jsonl(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)


def _model_of(line: Line) -> str | None:
    model = msgspec.json.decode(line.body).get("model")
    return model if isinstance(model, str) else None
