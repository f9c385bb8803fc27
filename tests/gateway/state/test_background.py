"""gateway/state/background.py: background responses leased to one replica at a
time, their events numbered and written only by the lease's holder, read by
their owner, cancelled once."""

from __future__ import annotations

import time

import msgspec
import pytest

from gateway.state.background import Background
from gateway.state.db import Database
from gateway.state.response_store import IdTaken, Responses


def store_of(database: Database) -> Background:
    return Background(database, Responses(database, 3600), retention_seconds=3600)


def record(status: str = "queued") -> bytes:
    return msgspec.json.encode({"response": {"status": status}, "items": []})


def test_a_response_is_claimed_by_one_runner_and_taken_over_once_its_lease_lapses(
    database: Database,
) -> None:
    store = store_of(database)
    store.create("resp_1", "key_a", b'{"input":"hi"}', record())
    [claimed] = store.claim("runner-a", 10, lease=3600)
    assert (claimed.id, claimed.owner, claimed.request, claimed.sent) == (
        "resp_1",
        "key_a",
        b'{"input":"hi"}',
        [],
    )
    assert store.claim("runner-b", 10, lease=3600) == []  # its lease holds
    assert store.append("runner-a", "resp_1", 0, [b'{"n":0}', b'{"n":1}'])
    # The lease lapses (runner-a died): runner-b gets it with what was sent.
    assert store.renew("runner-a", -1, ["resp_1"]) == {"resp_1"}
    [again] = store.claim("runner-b", 10, lease=3600)
    assert again.sent == [b'{"n":0}', b'{"n":1}']
    # runner-a, alive after all, may write no more; runner-b goes on.
    assert not store.append("runner-a", "resp_1", 2, [b'{"n":"a"}'])
    assert store.renew("runner-a", 3600, ["resp_1"]) == set()
    assert store.append("runner-b", "resp_1", 2, [b'{"n":2}'], record("completed"), "completed")
    status, events = store.events("resp_1", 0, "key_a") or ("", [])
    assert status == "completed" and events == [(1, b'{"n":1}'), (2, b'{"n":2}')]
    assert store.claim("runner-c", 10, lease=3600) == []  # ended: nobody runs it again
    assert not store.append("runner-b", "resp_1", 3, [b"{}"])  # nor adds to it


def test_only_its_owner_reads_or_cancels_it(database: Database) -> None:
    store = store_of(database)
    store.create("resp_1", "key_a", b"{}", record())
    assert store.events("resp_1", -1, "key_b") is None
    assert store.cancel("resp_1", "key_b") is None
    assert store.events("resp_1", -1, None) == ("queued", [])  # an admin, or no keys


def test_a_cancel_ends_it_and_stops_its_runner_writing(database: Database) -> None:
    store = store_of(database)
    store.create("resp_1", None, b"{}", record())
    store.claim("runner-a", 10, lease=3600)
    before, stored = store.cancel("resp_1", None) or ("", b"")
    assert before == "in_progress"
    assert msgspec.json.decode(stored)["response"]["status"] == "cancelled"
    assert not store.append("runner-a", "resp_1", 0, [b"{}"])
    assert store.cancel("resp_1", None) is not None  # again: said, nothing changes
    assert store.status("resp_1", None) == "cancelled"
    assert store.claim("runner-b", 10, lease=3600) == []


def test_an_id_in_use_is_refused(database: Database) -> None:
    store = store_of(database)
    store.create("resp_1", "key_a", b"{}", record())
    with pytest.raises(IdTaken):
        store.create("resp_1", "key_a", b"{}", record())
    store.responses.put("resp_2", b"{}", owner="key_a")
    with pytest.raises(IdTaken):
        store.create("resp_2", "key_b", b"{}", record())


def test_a_stopping_runner_gives_its_responses_back(database: Database) -> None:
    store = store_of(database)
    store.create("resp_1", None, b"{}", record())
    store.claim("runner-a", 10, lease=3600)
    assert store.release_all("runner-a") == 1
    assert [c.id for c in store.claim("runner-b", 10, lease=3600)] == ["resp_1"]


def test_events_expire_with_it(database: Database) -> None:
    store = store_of(database)
    store.create("resp_1", None, b"{}", record())
    store.claim("runner-a", 10, lease=3600)
    store.append("runner-a", "resp_1", 0, [b"{}"])
    assert store.expire(time.time() + 60) == 0
    assert store.expire(time.time() + 3601) == 1
    assert store.events("resp_1", -1, None) is None
