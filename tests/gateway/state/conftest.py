"""Each state store test runs on both backends: SQLite in a temporary state
directory, and a fresh database on the session's real PostgreSQL."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.state.db import Database

_names = itertools.count()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A store with no schema yet."""
    url = ""
    if request.param == "postgresql":
        server = request.getfixturevalue("postgres_server")
        url = server.create_database(f"state_{next(_names)}")
    db = Database(url, tmp_path / "state")
    try:
        yield db
    finally:
        db.close()


@pytest.fixture
def database(empty_database: Database) -> Database:
    """A store with the whole schema."""
    empty_database.migrate()
    return empty_database
