"""gateway/state/responses.py: stored responses kept for their retention, then deleted."""

from __future__ import annotations

import time

from gateway.state.db import Database
from gateway.state.responses import Responses


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
