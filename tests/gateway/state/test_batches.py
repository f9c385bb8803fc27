"""gateway/state/batches.py: jobs and lines in OpenAI's shapes; leases that let
replicas share a job's lines, each committed once; ending a job, again if need be."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai.types
import pytest
from sqlalchemy import update

from gateway.batch import jsonl
from gateway.state.batches import STATUSES, Batches, Ending, output_line
from gateway.state.db import Database
from gateway.state.files import Files
from gateway.state.tables import lines as lines_table
from tests.harness.at_once import at_once, raised

CHAT = "/v1/chat/completions"


def lines(count: int) -> list[jsonl.Line]:
    data = "\n".join(
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {"model": "m"}})
        for i in range(count)
    )
    return jsonl.parse(data.encode())


def batches_on(database: Database) -> Batches:
    return Batches(database, Files(database), output_seconds=3600)


@pytest.fixture
def store(database: Database) -> Batches:
    return batches_on(database)


def running(store: Batches, count: int, metadata: dict[str, str] | None = None) -> str:
    batch = store.create("file-x", CHAT, "24h", metadata, lines(count))
    assert store.start_validated() == [batch["id"]]
    return str(batch["id"])


def ok(custom_id: str) -> dict[str, Any]:
    return output_line(custom_id, 200, "r", {"ok": custom_id})


def lapse(database: Database, owner: str) -> None:
    """``owner``'s leases run out (its replica died)."""
    with database.write() as db:
        db.execute(
            update(lines_table).where(lines_table.c.lease_owner == owner).values(lease_until=0)
        )


def test_a_job_runs_line_by_line_and_ends_with_its_files(store: Batches) -> None:
    batch = store.create("file-x", CHAT, "24h", {"k": "v"}, lines(3))
    parsed = openai.types.Batch.model_validate(batch)
    assert parsed.status == "validating" and parsed.request_counts is not None
    assert parsed.request_counts.total == 3 and parsed.model == "m"
    assert store.lines.claim("a", 10, 30) == []  # validating: not yet
    store.start_validated()
    claimed = store.lines.claim("a", 10, 30)
    assert [c.line.custom_id for c in claimed] == ["c0", "c1", "c2"]
    assert store.lines.finish_line("a", batch["id"], 0, False, ok("c0"))
    assert store.lines.finish_line(
        "a", batch["id"], 2, True, output_line("c2", 400, "r2", {"error": {}})
    )
    # A line committed twice (a race, a bug) keeps its first result.
    assert not store.lines.finish_line("a", batch["id"], 0, True, output_line("c0", 500, "r0", {}))
    counts = store.get(batch["id"])["request_counts"]  # type: ignore[index]
    assert counts == {"total": 3, "completed": 1, "failed": 1}
    store.lines.release("a", batch["id"], 1)
    store.set_status(batch["id"], "cancelling", ("in_progress",))
    assert store.ending() == [Ending(batch["id"], "cancelled")]

    done, unrun = store.finalize(batch["id"], "cancelled", "batch_cancelled", "not run")
    assert unrun == 1 and done["status"] == "cancelled" and done["cancelled_at"]
    output = store.files.content(done["output_file_id"]).splitlines()  # type: ignore[union-attr]
    failed = store.files.content(done["error_file_id"]).splitlines()  # type: ignore[union-attr]
    assert [json.loads(x)["custom_id"] for x in output] == ["c0"]
    assert json.loads(output[0])["response"]["body"] == {"ok": "c0"}
    by_id = {json.loads(x)["custom_id"]: json.loads(x) for x in failed}
    assert by_id["c2"]["response"]["status_code"] == 400
    assert by_id["c1"]["error"]["code"] == "batch_cancelled" and by_id["c1"]["response"] is None
    assert store.ending() == []
    # Ending again (a replica killed while ending it) writes the same files.
    again, _ = store.finalize(batch["id"], "cancelled", "batch_cancelled", "not run")
    assert again["output_file_id"] == done["output_file_id"]
    outputs = store.files.page("batch_output", None, 10, True)[0]
    assert len(outputs) == 2 and all(f["expires_at"] for f in outputs)


def test_replicas_claim_different_lines_and_a_dead_ones_lapse_to_the_others(
    store: Batches, database: Database
) -> None:
    batch_id = running(store, 6)
    first = store.lines.claim("a", 4, 30)
    second = store.lines.claim("b", 4, 30)
    assert [c.line.index for c in first] == [0, 1, 2, 3]
    assert [c.line.index for c in second] == [4, 5]
    assert store.lines.claim("b", 4, 30) == []  # every line is held
    assert store.lines.finish_line("a", batch_id, 0, False, ok("c0"))
    lapse(database, "a")  # replica a dies with 1, 2, 3 in flight
    taken = store.lines.claim("b", 10, 30)
    assert [c.line.index for c in taken] == [1, 2, 3]
    # a comes back from a long stall: its lease is gone, its results are not taken.
    assert not store.lines.finish_line("a", batch_id, 1, False, ok("c1-a"))
    for claimed in [*second, *taken]:
        assert store.lines.finish_line(
            "b", batch_id, claimed.line.index, False, ok(claimed.line.custom_id)
        )
    assert store.ending() == [Ending(batch_id, "completed")]
    done, unrun = store.finalize(batch_id, "completed", "", "")
    assert unrun == 0 and done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    output = store.files.content(done["output_file_id"]).splitlines()  # type: ignore[union-attr]
    assert [json.loads(x)["response"]["body"]["ok"] for x in output] == [f"c{i}" for i in range(6)]


def test_an_answer_after_a_lapse_nobody_took_over_is_kept(
    store: Batches, database: Database
) -> None:
    batch_id = running(store, 1)
    [claimed] = store.lines.claim("a", 1, 30)
    lapse(database, "a")  # a stalled past its lease; no other replica claimed the line
    assert store.lines.finish_line("a", batch_id, claimed.line.index, False, ok("c0"))
    assert store.lines.claim("b", 1, 30) == []  # done: it does not run again


def test_a_renewed_lease_outlives_its_first_deadline(store: Batches, database: Database) -> None:
    batch_id = running(store, 1)
    [claimed] = store.lines.claim("a", 1, 30)
    with database.write() as db:  # the first deadline is as good as past
        db.execute(update(lines_table).values(lease_until=1))
    assert store.lines.renew("a", 30, [(batch_id, claimed.line.index)]) == 1
    assert store.lines.claim("b", 1, 30) == []
    assert store.lines.finish_line("a", batch_id, claimed.line.index, False, ok("c0"))
    assert store.lines.renew("a", 30, [(batch_id, claimed.line.index)]) == 0  # done


def test_only_the_lines_still_running_are_renewed(store: Batches, database: Database) -> None:
    batch_id = running(store, 2)
    still, given_up = store.lines.claim("a", 2, 30)
    lapse(database, "a")
    # a gave up on line 1 while the store was down: it lapses to another replica.
    assert store.lines.renew("a", 30, [(batch_id, still.line.index)]) == 1
    assert [c.line.index for c in store.lines.claim("b", 2, 30)] == [given_up.line.index]


def test_claims_at_once_never_take_a_line_twice(database: Database) -> None:
    store = batches_on(database)
    running(store, 200)

    def claim_all(replica: int) -> list[int]:
        mine: list[int] = []
        while claimed := batches_on(database).lines.claim(f"r{replica}", 7, 30):
            mine += [c.line.index for c in claimed]
        return mine

    results = at_once(4, claim_all)
    assert not raised(results), results
    every = sorted(i for mine in results if isinstance(mine, list) for i in mine)
    assert every == list(range(200))


def test_only_one_replica_takes_the_lease_on_ending_a_job(store: Batches) -> None:
    batch_id = running(store, 1)
    assert store.take(batch_id, "a", 30)
    assert not store.take(batch_id, "b", 30)
    assert store.ending() == []  # being ended by a


def test_a_job_ended_by_one_replica_is_not_taken_by_another_that_listed_it(
    store: Batches,
) -> None:
    batch_id = running(store, 1)
    [claimed] = store.lines.claim("a", 1, 30)
    assert store.lines.finish_line("a", batch_id, claimed.line.index, False, ok("c0"))
    assert [e.batch_id for e in store.ending()] == [batch_id]  # b lists it too
    assert store.take(batch_id, "a", 30)
    store.finalize(batch_id, "completed", "", "")
    assert not store.take(batch_id, "b", 30)  # b finds it ended


def test_a_job_past_its_window_expires_once_nothing_runs(
    store: Batches, database: Database
) -> None:
    batch_id = running(store, 2)
    [claimed] = store.lines.claim("a", 1, 30)
    from gateway.state.tables import batches as batches_table

    with database.write() as db:
        db.execute(update(batches_table).values(expires_at=0))
    assert store.lines.claim("b", 5, 30) == []  # nothing new starts past the window
    assert store.ending() == []  # a line still runs
    store.lines.release("a", batch_id, claimed.line.index)
    assert store.ending() == [Ending(batch_id, "expired")]


def test_state_survives_a_new_database_on_the_same_directory(tmp_path: Path) -> None:
    first = Database("", tmp_path)
    first.migrate()
    store = batches_on(first)
    batch_id = running(store, 2)
    store.lines.claim("a", 2, 30)
    store.lines.finish_line("a", batch_id, 1, False, ok("c1"))
    first.close()
    second = Database("", tmp_path)
    assert second.migrate() == []
    again = batches_on(second)
    lapse(second, "a")
    assert [c.line.index for c in again.lines.claim("b", 5, 30)] == [0]
    assert again.job_counts()["in_progress"] == 1


def test_set_status_moves_only_from_the_given_statuses(store: Batches) -> None:
    batch = store.create("file-x", CHAT, "24h", None, lines(1))
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


def test_a_job_its_lines_and_its_files_are_its_owners(store: Batches) -> None:
    mine = store.create("file-x", CHAT, "24h", None, lines(2), owner="team-a")["id"]
    theirs = store.create("file-y", CHAT, "24h", None, lines(1), owner="team-b")["id"]
    assert store.get(mine, "team-a") is not None and store.get(theirs, "team-a") is None
    assert [b["id"] for b in store.page(None, 10, "team-a")[0]] == [mine]
    assert [b["id"] for b in store.page(None, 10)[0]] == [theirs, mine]
    assert store.set_status(theirs, "cancelling", ("validating",), "team-a") is None
    assert store.get(theirs)["status"] == "validating"  # type: ignore[index]
    store.start_validated()
    claimed = store.lines.claim("a", 10, 30)
    assert {(c.batch_id, c.owner) for c in claimed} == {(mine, "team-a"), (theirs, "team-b")}
    for c in claimed:
        store.lines.finish_line("a", c.batch_id, c.line.index, False, ok(c.line.custom_id))
    done, _ = store.finalize(mine, "completed", "", "")
    assert store.files.get(done["output_file_id"], "team-a") is not None
    assert store.files.get(done["output_file_id"], "team-b") is None


def test_a_job_that_ends_has_the_sum_of_its_answers_usage(store: Batches) -> None:
    batch_id = running(store, 3)
    claimed = store.lines.claim("a", 10, 30)
    for c, (prompt, completion) in zip(claimed, [(10, 2), (7, 3)], strict=False):
        usage = {"prompt_tokens": prompt, "completion_tokens": completion}
        result = output_line(c.line.custom_id, 200, "r", {"usage": usage})
        store.lines.finish_line("a", batch_id, c.line.index, False, result)
    error = output_line("c2", 400, "r", {"error": {}})
    store.lines.finish_line("a", batch_id, claimed[2].line.index, True, error)
    done, _ = store.finalize(batch_id, "completed", "", "")
    parsed = openai.types.Batch.model_validate(done)
    assert parsed.usage is not None
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens) == (17, 5)
    assert parsed.usage.total_tokens == 22
    assert parsed.usage.input_tokens_details.cached_tokens == 0


def test_a_cursor_naming_another_keys_job_is_an_unknown_one(store: Batches) -> None:
    """It paged on from that job's place in everyone's list."""
    store.create("file-x", CHAT, "24h", None, lines(1), owner="key_a")
    theirs = store.create("file-y", CHAT, "24h", None, lines(1), owner="key_b")["id"]
    store.create("file-z", CHAT, "24h", None, lines(1), owner="key_a")
    unknown = store.page("batch_unknown", 10, "key_a")
    assert store.page(theirs, 10, "key_a") == unknown == ([], False)
    assert len(store.page(theirs, 10)[0]) == 1  # an admin's cursor: any job
