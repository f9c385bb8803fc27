"""The state store's database: SQLite in the state directory, or PostgreSQL shared by replicas.

One SQLAlchemy engine either way; callers run each method in a thread
(``asyncio.to_thread``), never on the event loop, and each method is one
short transaction:

- ``read()``: a plain transaction.
- ``write()``: on SQLite ``BEGIN IMMEDIATE``, so a transaction that reads
  then writes takes the write lock first and never fails half way because
  another gateway process wrote meanwhile (WAL mode: readers never wait).
  On PostgreSQL, READ COMMITTED, with row locks where a method needs them.

A database that cannot be reached raises ``Unavailable`` (the routes that
need state answer 503; the engine reconnects on its own: ``pool_pre_ping``).
``migrate()`` brings the schema up to date under a lock (PostgreSQL's
advisory lock; SQLite's write lock), so replicas starting at once against an
empty database apply each migration exactly once.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy import Connection, Engine, event, select
from sqlalchemy.engine import make_url

from gateway.state.tables import MIGRATIONS, migrations_table
from shared.redact import redact_url

log = logging.getLogger(__name__)

# pg_advisory_xact_lock key held while migrating ("llmgate" in ASCII, roughly).
_MIGRATION_LOCK = 0x6C6C6D67617465
SQLITE_NAME = "state.sqlite3"
_UNREACHABLE = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError)


# A store that does not answer fails the call, not the gateway: at connect,
# and on a link that goes silent mid-call (a network partition sends no
# reset), where TCP keepalives and the user timeout end the call in about
# 30 s instead of never.
POSTGRES_CONNECT_ARGS: dict[str, Any] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


class Unavailable(Exception):
    """The state store cannot be reached (or answered with an error of its own)."""


def owner_name() -> str:
    """This process among replicas: host and pid (leases, migration records)."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Database:
    def __init__(self, url: str, directory: Path) -> None:
        """``url``: ``postgresql://...`` (``--state-db``), or empty for SQLite in ``directory``."""
        if url:
            parsed = self.check_url(url)
            self.where = redact_url(url)
            self.engine: Engine = sqlalchemy.create_engine(
                parsed.set(drivername="postgresql+psycopg"),
                pool_pre_ping=True,
                pool_size=4,
                connect_args=POSTGRES_CONNECT_ARGS,
            )
        else:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / SQLITE_NAME
            self.where = str(path)
            self.engine = sqlalchemy.create_engine(
                f"sqlite:///{path}",
                connect_args={"check_same_thread": False, "timeout": 30.0},
            )
            event.listen(self.engine, "connect", _sqlite_connect)
            event.listen(self.engine, "begin", _sqlite_begin)
        self.postgres = self.engine.dialect.name == "postgresql"
        self._writer = self.engine.execution_options(write=True)

    @staticmethod
    def check_url(url: str) -> sqlalchemy.URL:
        """``url`` parsed, or ValueError naming what is wrong (never the password)."""
        try:
            parsed = make_url(url)
        except sqlalchemy.exc.ArgumentError:
            raise ValueError(
                "--state-db must be a URL like postgresql://USER:PASSWORD@HOST:PORT/DB"
            ) from None
        if parsed.get_backend_name() != "postgresql":
            raise ValueError(
                "--state-db must be a postgresql:// URL (empty = SQLite in --state-dir), "
                f"not {redact_url(url)!r}"
            )
        return parsed

    def conninfo(self) -> str:
        """The PostgreSQL store as libpq's URL, for a connection of its own (its
        password in it: never logged)."""
        url = self.engine.url.set(drivername="postgresql")
        return url.render_as_string(hide_password=False)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with _reachable(), self.engine.begin() as connection:
            yield connection

    @contextmanager
    def write(self) -> Iterator[Connection]:
        with _reachable(), self._writer.begin() as connection:
            yield connection

    def migrate(self) -> list[str]:
        """Apply the migrations this database lacks; the names of those applied here."""
        applied: list[str] = []
        with self.write() as db:
            if self.postgres:
                db.execute(sqlalchemy.text(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})"))
            migrations_table.create(db, checkfirst=True)
            done = set(db.scalars(select(migrations_table.c.version)))
            for version, name, apply in MIGRATIONS:
                if version in done:
                    continue
                apply(db)
                db.execute(
                    migrations_table.insert().values(
                        version=version, name=name, applied_at=time.time(), applied_by=owner_name()
                    )
                )
                applied.append(f"{version} ({name})")
        for name in applied:
            log.info("state store %s: applied migration %s", self.where, name)
        return applied


@contextmanager
def _reachable() -> Iterator[None]:
    try:
        yield
    except _UNREACHABLE as exc:
        raise Unavailable(str(exc.orig or exc).strip().splitlines()[0]) from exc


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # Transactions are begun by _sqlite_begin, not by the driver.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    # Switching a new database to WAL while another process does the same can
    # fail at once with "database is locked" (SQLite's busy timeout does not
    # cover it): processes starting together try again.
    deadline = time.monotonic() + 30
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    # In WAL mode NORMAL loses nothing when a process dies; only a power cut
    # may lose the last commits.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(connection: Connection) -> None:
    write = connection.get_execution_options().get("write", False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
