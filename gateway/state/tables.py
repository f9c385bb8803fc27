"""The state store's tables, and the ordered migrations that make them.

One schema for both backends (SQLAlchemy Core renders it for SQLite and
PostgreSQL). A file's bytes are rows too (``file_chunks``), written in the
transaction of the file's row: one thing to back up and restore, and no object
store to test against. :data:`MIGRATIONS` are applied once each, in order,
inside the transaction that records them in ``schema_migrations``; applying them
is ``gateway.state.db``'s. Append new ones; never edit one that has shipped. The
tables below are the schema as it is now; a migration creates its tables as they
were then (``_V1``, ``_V2``), so on an empty database it does today what it did
when it shipped.
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
    text,
)

from shared import routes

metadata = MetaData()

# An auto-numbered creation order, for pages to follow (``seq`` columns):
# BIGINT on PostgreSQL, SQLite's rowid alias.
Seq = BigInteger().with_variant(Integer(), "sqlite")

# A file's bytes go in ``file_chunks`` rows of at most this many.
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


# The tables as migration 1 made them (before the columns migration 2 adds).
_V1 = MetaData()
for _table in (files, file_chunks, batches, lines, responses):
    _table.to_metadata(_V1)


def _create_v1(connection: Connection) -> None:
    _V1.create_all(connection, checkfirst=True)


# -- migration 2: usage per key, and who owns each file, batch and response ------------

# The id of the API key that made the row (``shared.api_keys.KeyEntry.id``;
# before migration 3, its name); NULL when no keys were configured (every
# caller sees it).
OWNED = (files, batches, responses)
for _table in OWNED:
    _table.append_column(Column("owner", String))
files_by_owner = Index("files_owner", files.c.owner, files.c.seq)
batches_by_owner = Index("batches_owner", batches.c.owner, batches.c.seq)

# What each key used, per model and UTC day (gateway.state.usage): counters
# that gateway processes add to, never set.
usage = Table(
    "usage",
    metadata,
    # The key's id (before migration 3, its name), or ANONYMOUS ("-") for
    # requests with no keys configured: whose usage it is.
    Column("key", String, primary_key=True),
    # The model the request named (an alias stays the alias).
    Column("model", String, primary_key=True),
    # The UTC day, YYYY-MM-DD.
    Column("day", String, primary_key=True),
    Column("requests", BigInteger, nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    # Tokens answered from the response cache, not computed by an engine.
    Column("cached_tokens", BigInteger, nullable=False),
)

# The flushes already added to ``usage``, so a flush tried again (its commit's
# answer was lost) is added once. Deleted after a day (``Usage.expire``).
usage_flushes = Table(
    "usage_flushes",
    metadata,
    Column("id", String, primary_key=True),
    Column("at", Integer, nullable=False, index=True),
)


# The usage table as migration 2 made it (before the column migration 3 adds).
_V2 = MetaData()
usage.to_metadata(_V2)


def _v2_usage_and_owners(connection: Connection) -> None:
    for table in OWNED:
        connection.execute(text(f"ALTER TABLE {table.name} ADD COLUMN owner VARCHAR"))
    files_by_owner.create(connection)
    batches_by_owner.create(connection)
    _V2.tables["usage"].create(connection)
    usage_flushes.create(connection)


# -- migration 3: owners are key ids; usage rows keep the key's name to show ----------

# Rows from before keep their owner, a key name: a key given ``id: <its old
# name>`` in the keys file owns them still; otherwise only an admin key sees them.

# The key's name when its usage was last added (what /v1/usage and people
# read); NULL in rows from before, whose ``key`` is the name itself.
usage.append_column(Column("key_name", String))


def _v3_usage_key_names(connection: Connection) -> None:
    connection.execute(text("ALTER TABLE usage ADD COLUMN key_name VARCHAR"))


# -- migration 4: background responses and their events ------------------------------

# A background response (``background: true``) the gateway runs itself: its
# request, where it stands, and the replica running it under a lease.
background = Table(
    "background",
    metadata,
    Column("id", String, primary_key=True),
    Column("owner", String),
    Column("created_at", Integer, nullable=False),
    # Unix seconds after which it and its events are deleted (its stored
    # response in ``responses`` keeps its own retention).
    Column("expires_at", Integer, nullable=False, index=True),
    # The Responses request as a worker gets it (JSON).
    Column("request", LargeBinary, nullable=False),
    # queued, in_progress, then completed, incomplete, failed or cancelled.
    Column("status", String, nullable=False),
    Column("lease_owner", String),
    Column("lease_until", Float),
    Index("background_status", "status"),
)

# Its stream's events, in order: what a client resuming after N reads.
response_events = Table(
    "response_events",
    metadata,
    Column("response_id", String, primary_key=True),
    Column("seq", Integer, primary_key=True),
    # The event's JSON (its ``data:``), sequence number included.
    Column("data", LargeBinary, nullable=False),
)

_V4 = MetaData()
for _table in (background, response_events):
    _table.to_metadata(_V4)


def _v4_background(connection: Connection) -> None:
    _V4.create_all(connection, checkfirst=True)


# -- migration 5: background streams of other routes ---------------------------------

# The route it runs: the Responses API's, or a chat or completion stream a
# client made resumable (``gateway.background.kinds``).
background.append_column(
    Column("path", String, nullable=False, server_default=routes.RESPONSES.path)
)


def _v5_background_paths(connection: Connection) -> None:
    connection.execute(
        text(
            "ALTER TABLE background ADD COLUMN path VARCHAR NOT NULL "
            f"DEFAULT '{routes.RESPONSES.path}'"
        )
    )


Migration = tuple[int, str, Callable[[Connection], None]]

MIGRATIONS: list[Migration] = [
    (1, "files, batches and their lines, stored responses", _create_v1),
    (
        2,
        "usage per key, model and day; an owner for files, batches, responses",
        _v2_usage_and_owners,
    ),
    (3, "owners are API key ids; usage rows keep the key's name", _v3_usage_key_names),
    (4, "background responses and their stream events", _v4_background),
    (5, "background streams of chat and completions", _v5_background_paths),
]
