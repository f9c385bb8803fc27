"""gateway/state/ledger.py: usage added up in memory, flushed in one transaction; a store
that is away keeps it in memory, and one whose answer to a commit was lost gets it once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import pytest

from gateway.state.db import Database, Unavailable
from gateway.state.ledger import Ledger
from gateway.state.usage import Counts, Row, Usage


class Flaky(Usage):
    """The real table, with a store that can go away: before the transaction
    (``down``), or after its commit, its answer lost (``lose_answer``)."""

    down = False
    lose_answer = False

    def add(
        self, flush_id: str, rows: Mapping[Row, Counts], names: Mapping[str, str] | None = None
    ) -> bool:
        if self.down:
            raise Unavailable("connection refused")
        added = super().add(flush_id, rows, names)
        if self.lose_answer:
            raise Unavailable("server closed the connection unexpectedly")
        return added


def today() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())


def stored(usage: Usage) -> dict[tuple[str, str], tuple[int, int, int, int]]:
    return {
        (r["key"], r["model"]): (
            r["requests"],
            r["prompt_tokens"],
            r["completion_tokens"],
            r["cached_tokens"],
        )
        for r in usage.rows(None, None, None, None)
    }


@pytest.fixture
def usage(database: Database) -> Flaky:
    return Flaky(database)


def ready() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


async def test_requests_add_up_in_memory_and_go_out_in_one_flush(usage: Flaky) -> None:
    ledger = Ledger(usage, ready())
    ledger.record("a", "m", 10, 2)
    ledger.record("a", "m", 5, 1, cached=6)
    ledger.record("-", "m", 1, 1)
    assert stored(usage) == {}  # nothing written on a request's way out
    assert await ledger.flush()
    assert stored(usage) == {("a", "m"): (2, 15, 3, 6), ("-", "m"): (1, 1, 1, 0)}
    assert usage.rows("a", None, None, None)[0]["day"] == today()
    assert await ledger.flush()  # nothing new: nothing sent
    assert stored(usage) == {("a", "m"): (2, 15, 3, 6), ("-", "m"): (1, 1, 1, 0)}


async def test_usage_waits_in_memory_while_the_store_is_away(usage: Flaky) -> None:
    ledger = Ledger(usage, ready())
    ledger.record("a", "m", 10, 2)
    usage.down = True
    assert not await ledger.flush()
    ledger.record("a", "m", 10, 2)  # and more comes meanwhile
    assert not await ledger.flush()
    assert ledger.pending().requests == 2 and stored(usage) == {}
    usage.down = False
    assert await ledger.flush()
    assert stored(usage) == {("a", "m"): (2, 20, 4, 0)} and ledger.pending().requests == 0


async def test_a_flush_whose_commit_answer_was_lost_is_not_counted_twice(usage: Flaky) -> None:
    ledger = Ledger(usage, ready())
    ledger.record("a", "m", 10, 2)
    usage.lose_answer = True
    assert not await ledger.flush()  # committed, but the ledger cannot know
    ledger.record("a", "m", 1, 1)
    usage.lose_answer = False
    assert await ledger.flush()
    assert stored(usage) == {("a", "m"): (2, 11, 3, 0)}


async def test_nothing_is_sent_before_the_store_has_answered(usage: Flaky) -> None:
    waiting = asyncio.Event()
    ledger = Ledger(usage, waiting)
    ledger.record("a", "m", 1, 1)
    assert not await ledger.flush()
    waiting.set()
    assert await ledger.flush() and stored(usage) == {("a", "m"): (1, 1, 1, 0)}


async def test_flushes_at_once_send_each_request_once(usage: Flaky) -> None:
    ledger = Ledger(usage, ready())
    for _ in range(50):
        ledger.record("a", "m", 1, 1)
    await asyncio.gather(*(ledger.flush() for _ in range(5)))
    assert stored(usage) == {("a", "m"): (50, 50, 50, 0)}


async def test_stopping_flushes_what_is_left(usage: Flaky) -> None:
    ledger = Ledger(usage, ready())
    ledger.start()
    ledger.record("a", "m", 3, 4)
    await ledger.stop()
    assert stored(usage) == {("a", "m"): (1, 3, 4, 0)}


async def test_usage_goes_to_the_keys_id_and_shows_its_name(usage: Flaky) -> None:
    """Two keys that had one name (revoked, then added again with a new secret)
    are two owners: neither's usage is the other's."""
    ledger = Ledger(usage, ready())
    ledger.record("key_old", "m", 1, 1, name="team-a")
    ledger.record("key_new", "m", 2, 2, name="team-a")
    assert await ledger.flush()
    [row] = usage.rows("key_new", None, None, None)
    assert (row["key"], row["key_id"], row["prompt_tokens"]) == ("team-a", "key_new", 2)
