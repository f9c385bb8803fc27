"""gateway/state/schema.py: migration 2 (usage, owners) on a store that migration 1 made
and that holds files, batches and responses: they stay, owned by no key."""

from __future__ import annotations

import time

from sqlalchemy import insert, select, text

from gateway.state.db import Database
from gateway.state.files import Files
from gateway.state.responses import Responses
from gateway.state.schema import MIGRATIONS, batches, files, migrations_table, responses
from gateway.state.usage import Counts, Usage


def migrate_to_v1(database: Database) -> None:
    """The store as a gateway of migration 1 left it."""
    with database.write() as db:
        migrations_table.create(db)
        version, name, apply = MIGRATIONS[0]
        apply(db)
        db.execute(
            migrations_table.insert().values(
                version=version, name=name, applied_at=time.time(), applied_by="test"
            )
        )


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

    assert database.migrate() == [f"2 ({MIGRATIONS[1][1]})"]
    assert database.migrate() == []
    with database.read() as db:
        assert db.scalar(select(batches.c.owner).where(batches.c.id == "batch_old")) is None
        versions = list(db.scalars(select(migrations_table.c.version)))
    assert versions == [1, 2]
    # Rows from before keys: everyone's (no viewer), no key's own.
    assert Files(database).get("file-old") is not None
    assert Files(database).get("file-old", "team-a") is None
    assert Responses(database, 60).get("resp_old") == b"{}"
    assert Responses(database, 60).get("resp_old", "team-a") is None
    # And the new table takes usage.
    usage = Usage(database)
    assert usage.add("flush-1", {("team-a", "m", "2025-06-01"): Counts(1, 2, 3, 0)})
    assert [row["requests"] for row in usage.rows(None, None, None, None)] == [1]
