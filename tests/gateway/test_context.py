"""gateway/context.py: one request's facts, typed: who owns what it makes, who it is shown as."""

from __future__ import annotations

from typing import Any

import pytest

from gateway import errors
from gateway.api.bands import asked_band
from gateway.context import RequestContext, context_of
from shared import api_keys, protocol

TEAM, OPS, BULK, MIDDLE = api_keys.parse(
    "keys:\n"
    "  - {name: team-a, key: sk-a}\n"
    "  - {name: ops, key: sk-ops, admin: true}\n"
    "  - {name: bulk, key: sk-bulk, priority: batch}\n"
    "  - {name: middle, key: sk-m, band: standard}\n",
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


def test_a_request_runs_in_its_keys_band_or_a_lower_one_it_asks_for() -> None:
    assert RequestContext(key=TEAM).band == protocol.INTERACTIVE
    assert RequestContext(key=MIDDLE).band == protocol.STANDARD
    assert RequestContext(key=TEAM, asked_band=protocol.STANDARD).band == protocol.STANDARD
    # Never higher than its key's: a standard key asking for interactive stays standard.
    assert RequestContext(key=MIDDLE, asked_band=protocol.INTERACTIVE).band == protocol.STANDARD
    assert RequestContext(key=MIDDLE, asked_band=protocol.BATCH).low_priority
    assert RequestContext(batch=True, asked_band=protocol.INTERACTIVE).band == protocol.BATCH


@pytest.mark.parametrize(
    ("header", "body", "band"),
    [
        (None, {}, protocol.INTERACTIVE),
        ("standard", {}, protocol.STANDARD),
        (" Batch ", {"service_tier": "priority"}, protocol.BATCH),  # the header wins
        (None, {"service_tier": "flex"}, protocol.BATCH),
        (None, {"service_tier": "default"}, protocol.INTERACTIVE),
        (None, {"service_tier": "priority"}, protocol.INTERACTIVE),
    ],
)
def test_the_band_a_request_asks_for(header: str | None, body: dict[str, Any], band: int) -> None:
    assert asked_band(header, body) == band


@pytest.mark.parametrize(
    ("header", "body", "param"),
    [("urgent", {}, "x-llmgate-band"), (None, {"service_tier": "gold"}, "service_tier")],
)
def test_an_unknown_band_is_a_400(header: str | None, body: dict[str, Any], param: str) -> None:
    with pytest.raises(errors.BadRequest) as refused:
        asked_band(header, body)
    assert refused.value.param == param and refused.value.status == 400


def test_a_scope_has_one_context_made_when_first_asked_for() -> None:
    scope: dict[str, Any] = {"type": "http"}
    context = context_of(scope)
    context.request_id = "r-1"
    assert context_of(scope) is context and context_of(scope).request_id == "r-1"
