"""tests/harness/postgres_server.py: a real PostgreSQL, a fresh database per test,
and an outage (stopped, started again on the same port)."""

from __future__ import annotations

import psycopg
import pytest

from tests.harness.postgres_server import PostgresServer


def select_one(url: str) -> int:
    with psycopg.connect(url, connect_timeout=10) as connection:
        row = connection.execute("select 1").fetchone()
    assert row is not None
    return int(row[0])


def test_databases_of_their_own_answer(postgres_server: PostgresServer) -> None:
    first = postgres_server.create_database("first_test_db")
    second = postgres_server.create_database("second_test_db")
    assert first != second
    assert select_one(first) == select_one(second) == 1
    with psycopg.connect(first) as connection:
        connection.execute("create table only_here (x int)")
    with psycopg.connect(second) as connection:
        row = connection.execute("select to_regclass('only_here')").fetchone()
    assert row == (None,)  # each database starts empty


def test_stopped_it_refuses_and_started_again_it_answers_on_the_same_port(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.create_database("outage_test_db")
    port = postgres_server.port
    postgres_server.stop()
    try:
        with pytest.raises(psycopg.OperationalError):
            select_one(url)
    finally:
        postgres_server.start()
    assert postgres_server.port == port
    assert select_one(url) == 1  # the database outlived the outage
