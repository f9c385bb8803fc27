"""gateway/state/tables.py: migration 2 (usage, owners) on a store that migration 1 made
and that holds files, batches and responses: they stay, owned by no key; migration 3
(owners are key ids) on a store with usage rows by key name: they stay that name's."""

from __future__ import annotations

import time

from sqlalchemy import insert, select, text

from gateway.state.db import Database
from gateway.state.files import Files
from gateway.state.response_store import Responses
from gateway.state.tables import MIGRATIONS, batches, files, migrations_table, responses
from gateway.state.usage import Counts, Usage


def migrate_to(database: Database, last: int) -> None:
    """The store as a gateway of migration ``last`` left it."""
    with database.write() as db:
        migrations_table.create(db)
        for version, name, apply in MIGRATIONS[:last]:
            apply(db)
            db.execute(
                migrations_table.insert().values(
                    version=version, name=name, applied_at=time.time(), applied_by="test"
                )
            )


def migrate_to_v1(database: Database) -> None:
    migrate_to(database, 1)


def test_migration_2_keeps_what_a_v1_store_holds_owned_by_no_key(
    empty_database: Database,
) -> None:
    database = empty_database
    migrate_to_v1(database)
    now = int(time.time())
    with database.write() as db:
        columns = db.execute(text("SELECT * FROM files LIMIT 0")).keys()
        assert "owner" not in columns  # migration 1 makes the tables as they were
        db.execute(
            insert(files).values(
                id="file-old", purpose="batch", filename="a.jsonl", bytes=0, created_at=now
            )
        )
        db.execute(
            insert(batches).values(
                id="batch_old", status="completed", created_at=now, expires_at=now, object=b"{}"
            )
        )
        db.execute(
            insert(responses).values(
                id="resp_old", created_at=now, expires_at=now + 60, record=b"{}"
            )
        )

    assert database.migrate() == [f"{v} ({name})" for v, name, _ in MIGRATIONS[1:]]
    assert database.migrate() == []
    with database.read() as db:
        assert db.scalar(select(batches.c.owner).where(batches.c.id == "batch_old")) is None
        versions = list(db.scalars(select(migrations_table.c.version)))
    assert versions == [v for v, _, _ in MIGRATIONS]
    # Rows from before keys: everyone's (no viewer), no key's own.
    assert Files(database).get("file-old") is not None
    assert Files(database).get("file-old", "team-a") is None
    assert Responses(database, 60).get("resp_old") == b"{}"
    assert Responses(database, 60).get("resp_old", "team-a") is None
    # And the new table takes usage.
    usage = Usage(database)
    assert usage.add("flush-1", {("team-a", "m", "2025-06-01"): Counts(1, 2, 3, 0)})
    assert [row["requests"] for row in usage.rows(None, None, None, None)] == [1]


def test_migration_3_keeps_usage_by_key_name_shown_and_owned_by_that_name(
    empty_database: Database,
) -> None:
    """Owners were key names: rows from then stay that name's, so a key given
    ``id: <its old name>`` keeps them, and no other key (a re-added name's new
    secret has a new id) gets them."""
    database = empty_database
    migrate_to(database, 2)
    with database.write() as db:
        columns = db.execute(text("SELECT * FROM usage LIMIT 0")).keys()
        assert "key_name" not in columns  # migration 2 makes the table as it was
        db.execute(
            text(
                "INSERT INTO usage (key, model, day, requests, prompt_tokens, "
                "completion_tokens, cached_tokens) VALUES ('team-a', 'm', '2025-06-01', 1, 2, 3, 0)"
            )
        )
    assert database.migrate() == [f"{v} ({name})" for v, name, _ in MIGRATIONS[2:]]
    usage = Usage(database)
    [row] = usage.rows("team-a", None, None, None)
    assert (row["key"], row["key_id"], row["requests"]) == ("team-a", "team-a", 1)
    assert usage.rows("key_0123456789abcdef", None, None, None) == []
    usage.add(
        "flush-1",
        {("key_0123456789abcdef", "m", "2025-06-01"): Counts(1, 0, 0, 0)},
        {"key_0123456789abcdef": "team-a"},
    )
    assert [r["key_id"] for r in usage.rows(None, None, None, None, name="team-a")] == [
        "key_0123456789abcdef",
        "team-a",
    ]
