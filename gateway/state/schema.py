"""The state store's tables, and the ordered migrations that make them.

One schema for both backends (SQLAlchemy Core renders it for SQLite and
PostgreSQL). ``seq`` columns give each table a creation order to page by
(SQLite's rowid, PostgreSQL's identity column). A file's bytes live in the
database too, in ``file_chunks`` rows of up to ``CHUNK_BYTES``: one thing to
back up and restore, written in the same transaction as the file's row, and
testable here with no object store.

A migration is a function of a connection, applied once, in order, inside
the transaction that records it in ``schema_migrations`` (``gateway.state.db``
holds a lock across that transaction so replicas starting at once apply each
migration exactly once). Append new ones; never edit one that has shipped.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
)

metadata = MetaData()

# An auto-numbered creation order: BIGINT on PostgreSQL, SQLite's rowid alias.
Seq = BigInteger().with_variant(Integer(), "sqlite")

CHUNK_BYTES = 1024 * 1024

migrations_table = Table(
    "schema_migrations",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("name", String, nullable=False),
    Column("applied_at", Float, nullable=False),
    Column("applied_by", String, nullable=False),
)

files = Table(
    "files",
    metadata,
    Column("seq", Seq, primary_key=True, autoincrement=True),
    Column("id", String, nullable=False, unique=True),
    Column("purpose", String, nullable=False),
    Column("filename", String, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", Integer, nullable=False),
    # Unix seconds after which the file is deleted; NULL = kept.
    Column("expires_at", Integer),
)

file_chunks = Table(
    "file_chunks",
    metadata,
    Column("file_id", String, primary_key=True),
    Column("n", Integer, primary_key=True),
    Column("data", LargeBinary, nullable=False),
)

batches = Table(
    "batches",
    metadata,
    Column("seq", Seq, primary_key=True, autoincrement=True),
    Column("id", String, nullable=False, unique=True),
    Column("status", String, nullable=False),
    Column("created_at", Integer, nullable=False),
    Column("expires_at", Integer, nullable=False),
    # The OpenAI Batch object but for request_counts (counted from lines).
    Column("object", LargeBinary, nullable=False),
    # Who is ending the job (writing its files), until when: one replica at a time.
    Column("lease_owner", String),
    Column("lease_until", Float),
)

lines = Table(
    "lines",
    metadata,
    Column("batch_id", String, primary_key=True),
    Column("line", Integer, primary_key=True),
    Column("custom_id", String, nullable=False),
    Column("url", String, nullable=False),
    Column("body", LargeBinary, nullable=False),
    # pending, then completed (an answer) or failed (an error answer)
    Column("state", String, nullable=False, server_default="pending"),
    # The output or error file's line, once run.
    Column("result", LargeBinary),
    # The replica running the line, until when (it renews while it runs).
    Column("lease_owner", String),
    Column("lease_until", Float),
    # The runner that committed the result (host:pid:token): who ran what.
    Column("done_by", String),
    Index("lines_pending", "state", "batch_id"),
)

responses = Table(
    "responses",
    metadata,
    Column("id", String, primary_key=True),
    Column("created_at", Integer, nullable=False),
    Column("expires_at", Integer, nullable=False, index=True),
    # gateway.api.responses.Record as JSON: the response and its conversation.
    Column("record", LargeBinary, nullable=False),
)


def _create_v1(connection: Connection) -> None:
    metadata.create_all(
        connection, tables=[files, file_chunks, batches, lines, responses], checkfirst=True
    )


Migration = tuple[int, str, Callable[[Connection], None]]

MIGRATIONS: list[Migration] = [
    (1, "files, batches and their lines, stored responses", _create_v1),
]
