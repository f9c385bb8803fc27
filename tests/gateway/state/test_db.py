"""gateway/state/db.py: the two backends, migrations applied once when replicas start
at once, a store that does not answer, and a --state-db that cannot be used."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from gateway.state.db import Database, Unavailable
from gateway.state.tables import MIGRATIONS, migrations_table
from tests.harness.at_once import at_once, raised
from tests.harness.postgres_server import PostgresServer


def migrate_at_once(url: str, directory: Path, replicas: int) -> list[list[str]]:
    """``replicas`` databases on one store, migrating at the same moment."""
    databases = [Database(url, directory) for _ in range(replicas)]
    results = at_once(replicas, lambda i: databases[i].migrate())
    for database in databases:
        database.close()
    assert not raised(results), results
    return [r for r in results if isinstance(r, list)]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_replicas_starting_at_once_migrate_an_empty_store_once(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = ""
    if backend == "postgresql":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        url = server.create_database("migrate_at_once")
    applied = migrate_at_once(url, tmp_path, replicas=6)
    assert sorted(len(names) for names in applied) == [0] * 5 + [len(MIGRATIONS)]
    database = Database(url, tmp_path)
    with database.read() as db:
        versions = list(db.scalars(select(migrations_table.c.version)))
    assert versions == [version for version, *_ in MIGRATIONS]
    assert database.migrate() == []  # and a later start finds nothing to do
    database.close()


def test_a_store_that_does_not_answer_is_unavailable(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    url = postgres_server.create_database("unanswered").replace(f":{postgres_server.port}/", ":1/")
    database = Database(url, tmp_path)
    with pytest.raises(Unavailable):
        database.migrate()


@pytest.mark.parametrize(
    "url", ["mysql://u@h/db", "sqlite:///x.db", "not a url at all", "postgresql+asyncpg://h/db?x"]
)
def test_a_state_db_that_is_not_postgresql_is_refused_by_name(url: str, tmp_path: Path) -> None:
    if url.startswith("postgresql"):
        Database.check_url(url)  # a PostgreSQL driver of its own is still PostgreSQL
        return
    with pytest.raises(ValueError, match="--state-db must be"):
        Database(url, tmp_path)


def test_the_password_never_shows_in_where_the_store_is(tmp_path: Path) -> None:
    database = Database("postgresql://u:secret@127.0.0.1:1/db", tmp_path)
    assert "secret" not in database.where and "***" in database.where
