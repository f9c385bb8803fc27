"""gateway/context.py: one request's facts, typed: who owns what it makes, who it is shown as."""

from __future__ import annotations

from typing import Any

from gateway.context import RequestContext, context_of
from shared import api_keys

TEAM, OPS, BULK = api_keys.parse(
    "keys:\n"
    "  - {name: team-a, key: sk-a}\n"
    "  - {name: ops, key: sk-ops, admin: true}\n"
    "  - {name: bulk, key: sk-bulk, priority: batch}\n",
    "keys.yaml",
)


def test_what_a_key_makes_is_owned_by_its_id_and_shown_by_its_name() -> None:
    context = RequestContext(key=TEAM)
    assert context.owner == context.viewer == context.key_id == TEAM.id != "team-a"
    assert context.key_name == "team-a"


def test_an_admin_key_sees_everyones_and_owns_its_own() -> None:
    context = RequestContext(key=OPS)
    assert context.owner == OPS.id and context.viewer is None


def test_without_keys_nobody_owns_anything_and_usage_is_anonymous() -> None:
    context = RequestContext()
    assert context.owner is None and context.viewer is None
    assert context.key_id == context.key_name == api_keys.ANONYMOUS


def test_batch_lines_and_batch_keys_run_after_interactive_requests() -> None:
    assert RequestContext(batch=True).low_priority
    assert RequestContext(key=BULK).low_priority
    assert not RequestContext(key=TEAM).low_priority


def test_a_scope_has_one_context_made_when_first_asked_for() -> None:
    scope: dict[str, Any] = {"type": "http"}
    context = context_of(scope)
    context.request_id = "r-1"
    assert context_of(scope) is context and context_of(scope).request_id == "r-1"
