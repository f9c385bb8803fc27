"""gateway/state/usage.py: usage rows that flushes add to, atomically, each flush once,
on both backends; filters; a batch's usage from its answers."""

from __future__ import annotations

from datetime import date

import msgspec

from gateway.state.batches import output_line
from gateway.state.db import Database
from gateway.state.usage import Counts, Usage, batch_usage
from tests.harness.at_once import at_once

DAY = "2025-06-01"


def totals(usage: Usage) -> dict[tuple[str, str, str], tuple[int, int, int, int]]:
    return {
        (row["key"], row["model"], row["day"]): (
            row["requests"],
            row["prompt_tokens"],
            row["completion_tokens"],
            row["cached_tokens"],
        )
        for row in usage.rows(None, None, None, None)
    }


def test_flushes_add_to_the_rows(database: Database) -> None:
    usage = Usage(database)
    assert usage.add(
        "f1", {("a", "m", DAY): Counts(1, 10, 5, 0), ("b", "m", DAY): Counts(2, 1, 1, 2)}
    )
    assert usage.add(
        "f2", {("a", "m", DAY): Counts(3, 30, 15, 4), ("a", "m", "2025-06-02"): Counts(1, 1, 1, 0)}
    )
    assert totals(usage) == {
        ("a", "m", DAY): (4, 40, 20, 4),
        ("b", "m", DAY): (2, 1, 1, 2),
        ("a", "m", "2025-06-02"): (1, 1, 1, 0),
    }


def test_a_flush_tried_again_is_added_once(database: Database) -> None:
    usage = Usage(database)
    rows = {("a", "m", DAY): Counts(1, 10, 5, 0)}
    assert usage.add("f1", rows)
    assert not usage.add("f1", rows)  # its first commit went through after all
    assert totals(usage) == {("a", "m", DAY): (1, 10, 5, 0)}


def test_processes_flushing_the_same_row_at_once_lose_nothing(database: Database) -> None:
    usage = Usage(database)
    rows = {("a", "m", DAY): Counts(1, 10, 5, 1), ("b", "m", DAY): Counts(1, 1, 1, 0)}
    assert at_once(8, lambda i: usage.add(f"process-{i}", rows)) == [True] * 8
    assert totals(usage) == {("a", "m", DAY): (8, 80, 40, 8), ("b", "m", DAY): (8, 8, 8, 0)}


def test_one_flush_sent_twice_at_once_is_added_once(database: Database) -> None:
    usage = Usage(database)
    rows = {("a", "m", DAY): Counts(1, 10, 5, 0)}
    assert sorted(at_once(4, lambda _: usage.add("same", rows))) == [False] * 3 + [True]  # type: ignore[type-var]
    assert totals(usage) == {("a", "m", DAY): (1, 10, 5, 0)}


def test_rows_are_filtered_by_key_model_and_days(database: Database) -> None:
    usage = Usage(database)
    usage.add(
        "f1",
        {
            ("a", "m", "2025-06-01"): Counts(1, 1, 1, 0),
            ("a", "n", "2025-06-02"): Counts(1, 1, 1, 0),
            ("b", "m", "2025-06-03"): Counts(1, 1, 1, 0),
        },
    )

    def found(*filters: object) -> list[tuple[str, str, str]]:
        return [(r["key"], r["model"], r["day"]) for r in usage.rows(*filters)]  # type: ignore[arg-type]

    assert found("a", None, None, None) == [("a", "m", "2025-06-01"), ("a", "n", "2025-06-02")]
    assert found(None, "m", None, None) == [("a", "m", "2025-06-01"), ("b", "m", "2025-06-03")]
    assert found(None, None, date(2025, 6, 2), date(2025, 6, 3)) == [
        ("a", "n", "2025-06-02"),
        ("b", "m", "2025-06-03"),
    ]
    assert found("b", None, None, date(2025, 6, 2)) == []


def test_flush_ids_are_forgotten_after_a_day(database: Database) -> None:
    usage = Usage(database)
    usage.add("f1", {})
    assert usage.expire() == 0
    assert usage.expire(now=2e10) == 1


def test_a_batch_usage_is_the_sum_of_its_answers() -> None:
    def answer(prompt: int, completion: int, cached: int | None = None) -> bytes:
        details = {"cached_tokens": cached} if cached is not None else None
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "prompt_tokens_details": details,
        }
        return msgspec.json.encode(output_line("c", 200, "r", {"usage": usage}))

    results = [
        answer(10, 2),
        answer(7, 3, cached=4),
        msgspec.json.encode(output_line("c", 200, "r", {})),
    ]
    assert batch_usage(results) == {
        "input_tokens": 17,
        "input_tokens_details": {"cached_tokens": 4},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 22,
    }


def test_rows_are_owned_by_key_ids_and_show_key_names(database: Database) -> None:
    """A name revoked and added again with a new secret is a new key id: it sees
    none of the old key's usage, though both show under the one name."""
    usage = Usage(database)
    usage.add(
        "f1",
        {("key_old", "m", DAY): Counts(1, 1, 1, 0), ("key_new", "m", DAY): Counts(2, 2, 2, 0)},
        {"key_old": "team-a", "key_new": "team-a"},
    )
    [row] = usage.rows("key_new", None, None, None)
    assert (row["key"], row["key_id"], row["requests"]) == ("team-a", "key_new", 2)
    # An admin asks by name: both keys that had it.
    assert [r["key_id"] for r in usage.rows(None, None, None, None, name="team-a")] == [
        "key_new",
        "key_old",
    ]
    # A key renamed in the file (its id kept) shows under its latest name.
    usage.add("f2", {("key_new", "m", DAY): Counts(1, 0, 0, 0)}, {"key_new": "team-b"})
    [row] = usage.rows("key_new", None, None, None)
    assert (row["key"], row["requests"]) == ("team-b", 3)
