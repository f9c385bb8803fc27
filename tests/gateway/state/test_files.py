"""gateway/state/files.py: files in OpenAI's shape, their bytes in chunks, expiry."""

from __future__ import annotations

import time

import openai.types
import pytest

from gateway.state import files as files_module
from gateway.state.db import Database
from gateway.state.files import Files
from gateway.state.tables import CHUNK_BYTES


def test_a_file_round_trips_in_openai_shape(database: Database) -> None:
    files = Files(database)
    made = files.add(b"abc\n", "in.jsonl", "batch")
    parsed = openai.types.FileObject.model_validate(made)
    assert parsed.id.startswith("file-") and parsed.bytes == 4 and parsed.purpose == "batch"
    assert files.get(made["id"]) == made
    assert files.content(made["id"]) == b"abc\n"
    assert files.delete(made["id"]) and files.get(made["id"]) is None
    assert files.content(made["id"]) is None and not files.delete(made["id"])


def test_a_file_larger_than_a_chunk_comes_back_whole(database: Database) -> None:
    files = Files(database)
    data = bytes(range(256)) * (CHUNK_BYTES // 256 * 2 + 3)  # two chunks and a bit
    made = files.add(data, "big.jsonl", "batch")
    assert files.content(made["id"]) == data and made["bytes"] == len(data)
    assert files.add(b"", "empty.jsonl", "batch")["bytes"] == 0


def test_writing_a_file_again_under_its_id_replaces_it(database: Database) -> None:
    files = Files(database)
    files.add(b"first" * CHUNK_BYTES, "out.jsonl", "batch_output", "file-fixed")
    files.add(b"second", "out.jsonl", "batch_output", "file-fixed")
    assert files.content("file-fixed") == b"second"
    assert files.total_bytes() == len(b"second")


def test_lists_page_by_creation_order(database: Database) -> None:
    files = Files(database)
    ids = [files.add(b"x", f"{i}", "batch")["id"] for i in range(5)]
    page, more = files.page(None, None, 2, ascending=False)
    assert [f["id"] for f in page] == [ids[4], ids[3]] and more
    page, more = files.page(None, ids[1], 10, ascending=True)
    assert [f["id"] for f in page] == ids[2:] and not more
    assert files.page("batch_output", None, 10, ascending=True) == ([], False)


def test_expired_files_are_deleted_with_their_bytes(database: Database) -> None:
    files = Files(database)
    now = int(time.time())
    gone = files.add(b"old", "a", "batch", expires_at=now + 60)
    kept = files.add(b"new", "b", "batch", expires_at=now + 7200)
    forever = files.add(b"all", "c", "batch")
    assert gone["expires_at"] == now + 60
    assert files.expire(now + 3600) == 1
    assert files.get(gone["id"]) is None and files.content(gone["id"]) is None
    assert files.get(kept["id"]) is not None and files.get(forever["id"]) is not None
    assert files.total_bytes() == 6


def test_a_backlog_of_expired_files_goes_in_transactions_of_a_few_hundred(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files_module, "EXPIRE_AT_ONCE", 3)
    files = Files(database)
    now = int(time.time())
    for i in range(7):
        files.add(b"x", f"{i}", "batch", expires_at=now)
    kept = files.add(b"y", "kept", "batch", expires_at=now + 60)
    assert files.expire(now + 1) == 7
    page, more = files.page(None, None, 10, ascending=True)
    assert [f["id"] for f in page] == [kept["id"]] and not more


def test_a_key_sees_only_its_own_files_and_no_viewer_sees_all(database: Database) -> None:
    files = Files(database)
    mine = files.add(b"a", "a.jsonl", "batch", owner="team-a")["id"]
    theirs = files.add(b"b", "b.jsonl", "batch", owner="team-b")["id"]
    assert files.get(mine, "team-a") is not None and files.get(theirs, "team-a") is None
    assert files.content(theirs, "team-a") is None and files.content(mine, "team-a") == b"a"
    page, _ = files.page(None, None, 10, ascending=True, viewer="team-a")
    assert [f["id"] for f in page] == [mine]
    page, _ = files.page(None, None, 10, ascending=True)  # an admin, or no keys
    assert [f["id"] for f in page] == [mine, theirs]
    assert not files.delete(theirs, "team-a") and files.get(theirs) is not None
    assert files.delete(theirs) and files.get(theirs) is None


def test_a_cursor_naming_another_keys_file_is_an_unknown_one(database: Database) -> None:
    """It paged on from that file's place in everyone's list."""
    files = Files(database)
    files.add(b"a", "a.jsonl", "batch", owner="key_a")
    theirs = files.add(b"b", "b.jsonl", "batch", owner="key_b")["id"]
    files.add(b"c", "c.jsonl", "batch", owner="key_a")
    for ascending in (True, False):
        unknown = files.page(None, "file-unknown", 10, ascending, viewer="key_a")
        assert files.page(None, theirs, 10, ascending, viewer="key_a") == unknown == ([], False)
    assert len(files.page(None, theirs, 10, True)[0]) == 1  # an admin's cursor: any file
