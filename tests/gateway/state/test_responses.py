"""gateway/state/response_store.py: stored responses kept for their retention, then deleted."""

from __future__ import annotations

import time

import pytest

from gateway.state.db import Database
from gateway.state.response_store import IdTaken, Responses


def test_a_response_is_kept_for_its_retention_then_expires(database: Database) -> None:
    responses = Responses(database, retention_seconds=3600)
    responses.put("resp_1", b'{"a":1}')
    responses.put("resp_1", b'{"a":2}')  # stored again: the latest wins
    assert responses.get("resp_1") == b'{"a":2}' and responses.get("resp_2") is None
    assert responses.expire(time.time() + 60) == 0
    assert responses.expire(time.time() + 3601) == 1
    assert responses.get("resp_1") is None


def test_a_response_past_its_retention_is_not_served_before_the_reaper_runs(
    database: Database,
) -> None:
    Responses(database, retention_seconds=-1).put("resp_old", b"{}")
    assert Responses(database, retention_seconds=3600).get("resp_old") is None


def test_a_response_is_found_by_its_own_key_only(database: Database) -> None:
    responses = Responses(database, retention_seconds=3600)
    responses.put("resp_a", b"{}", owner="team-a")
    assert responses.get("resp_a", "team-a") == b"{}"
    assert responses.get("resp_a", "team-b") is None
    assert responses.get("resp_a") == b"{}"  # an admin, or no keys


def test_an_id_another_key_holds_is_never_replaced(database: Database) -> None:
    """``put`` deleted the row by id, whoever owned it: any key could overwrite
    another's stored response by choosing its id."""
    responses = Responses(database, retention_seconds=3600)
    responses.put("resp_a", b'{"by":"a"}', owner="key_a")
    assert responses.taken("resp_a", "key_b") and not responses.taken("resp_a", "key_a")
    assert not responses.taken("resp_new", "key_b")
    with pytest.raises(IdTaken):
        responses.put("resp_a", b'{"by":"b"}', owner="key_b")
    with pytest.raises(IdTaken):
        responses.put("resp_a", b'{"by":"nobody"}')  # no keys now: still not its
    assert responses.get("resp_a") == b'{"by":"a"}'
    responses.put("resp_a", b'{"by":"a again"}', owner="key_a")  # its own: replaced
    assert responses.get("resp_a", "key_a") == b'{"by":"a again"}'


def test_an_expired_id_may_be_taken_by_another_key(database: Database) -> None:
    Responses(database, retention_seconds=-1).put("resp_old", b"{}", owner="key_a")
    responses = Responses(database, retention_seconds=3600)
    assert not responses.taken("resp_old", "key_b")
    responses.put("resp_old", b"{}", owner="key_b")
    assert responses.get("resp_old", "key_b") == b"{}"
    assert responses.get("resp_old", "key_a") is None
