"""gateway/batch/store.py: files, jobs and lines in SQLite; OpenAI's shapes; restart safety."""

from __future__ import annotations

import json
from pathlib import Path

import openai.types
import pytest

from gateway.batch import jsonl
from gateway.batch.store import STATUSES, Store, output_line

CHAT = "/v1/chat/completions"


def lines(count: int) -> list[jsonl.Line]:
    data = "\n".join(
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {"model": "m"}})
        for i in range(count)
    )
    return jsonl.parse(data.encode())


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "state")


def test_a_file_round_trips_in_openai_shape(store: Store) -> None:
    made = store.add_file(b"abc\n", "in.jsonl", "batch")
    parsed = openai.types.FileObject.model_validate(made)
    assert parsed.id.startswith("file-") and parsed.bytes == 4 and parsed.purpose == "batch"
    assert store.get_file(made["id"]) == made
    assert store.file_content(made["id"]) == b"abc\n"
    assert store.delete_file(made["id"]) and store.get_file(made["id"]) is None
    assert store.file_content(made["id"]) is None and not store.delete_file(made["id"])


def test_lists_page_by_creation_order(store: Store) -> None:
    ids = [store.add_file(b"x", f"{i}", "batch")["id"] for i in range(5)]
    page, more = store.list_files(None, None, 2, ascending=False)
    assert [f["id"] for f in page] == [ids[4], ids[3]] and more
    page, more = store.list_files(None, ids[1], 10, ascending=True)
    assert [f["id"] for f in page] == ids[2:] and not more
    assert store.list_files("batch_output", None, 10, ascending=True) == ([], False)


def test_a_job_runs_line_by_line_and_ends_with_its_files(store: Store) -> None:
    batch = store.create_batch("file-x", CHAT, "24h", {"k": "v"}, lines(3))
    parsed = openai.types.Batch.model_validate(batch)
    assert parsed.status == "validating" and parsed.request_counts is not None
    assert parsed.request_counts.total == 3 and parsed.model == "m"
    assert store.active_batches() == [(batch["id"], "validating")]
    store.set_status(batch["id"], "in_progress")
    store.finish_line(batch["id"], 0, False, output_line("c0", 200, "r0", {"ok": 1}))
    store.finish_line(batch["id"], 2, True, output_line("c2", 400, "r2", {"error": {}}))
    # A line committed twice (a race, a bug) keeps its first result.
    store.finish_line(batch["id"], 0, True, output_line("c0", 500, "r0", {}))
    assert [x.custom_id for x in store.pending_lines(batch["id"])] == ["c1"]
    counts = store.get_batch(batch["id"])["request_counts"]  # type: ignore[index]
    assert counts == {"total": 3, "completed": 1, "failed": 1}

    done, unrun = store.finalize(batch["id"], "cancelled", "batch_cancelled", "not run")
    assert unrun == 1 and done["status"] == "cancelled" and done["cancelled_at"]
    output = store.file_content(done["output_file_id"]).splitlines()  # type: ignore[union-attr]
    failed = store.file_content(done["error_file_id"]).splitlines()  # type: ignore[union-attr]
    assert [json.loads(x)["custom_id"] for x in output] == ["c0"]
    assert json.loads(output[0])["response"] == {
        "status_code": 200,
        "request_id": "r0",
        "body": {"ok": 1},
    }
    by_id = {json.loads(x)["custom_id"]: json.loads(x) for x in failed}
    assert by_id["c2"]["response"]["status_code"] == 400
    assert by_id["c1"]["error"]["code"] == "batch_cancelled" and by_id["c1"]["response"] is None
    assert store.active_batches() == []
    # Finalizing again (a gateway killed while finalizing) writes the same files.
    again, _ = store.finalize(batch["id"], "cancelled", "batch_cancelled", "not run")
    assert again["output_file_id"] == done["output_file_id"]
    assert len(store.list_files("batch_output", None, 10, True)[0]) == 2


def test_state_survives_a_new_store_on_the_same_directory(tmp_path: Path) -> None:
    first = Store(tmp_path)
    batch = first.create_batch("file-x", CHAT, "24h", None, lines(2))
    first.finish_line(batch["id"], 1, False, output_line("c1", 200, "r", {}))
    first.close()
    second = Store(tmp_path)
    assert [x.index for x in second.pending_lines(batch["id"])] == [0]
    assert second.job_counts()["validating"] == 1


def test_set_status_moves_only_from_the_given_statuses(store: Store) -> None:
    batch = store.create_batch("file-x", CHAT, "24h", None, lines(1))
    store.finalize(batch["id"], "completed", "", "")
    after = store.set_status(batch["id"], "cancelling", ("validating", "in_progress"))
    assert after is not None and after["status"] == "completed"
    assert store.set_status("batch_nope", "cancelling") is None


def test_every_status_timestamp_is_a_batch_field() -> None:
    fields = set(openai.types.Batch.model_fields)
    assert {f"{s}_at" for s in STATUSES if s != "validating"} <= fields


def test_the_state_directory_follows_the_flag_then_xdg(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.settings import resolve_state_dir

    monkeypatch.setenv("XDG_STATE_HOME", "/srv/state")
    assert resolve_state_dir("") == Path("/srv/state/llmgate")
    assert resolve_state_dir("/data/llmgate") == Path("/data/llmgate")
    monkeypatch.setenv("XDG_STATE_HOME", "relative/ignored")  # the spec: absolute only
    assert resolve_state_dir("") == Path.home() / ".local" / "state" / "llmgate"
