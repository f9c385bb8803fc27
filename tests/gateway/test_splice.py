"""gateway/background/splice.py: a run again goes on after the events sent, or says it cannot."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.background.splice import Diverged, Splice


def run(item: str, deltas: list[str]) -> list[dict[str, Any]]:
    """A run's events as a worker sends them: numbered its own way, its own item id."""
    return [
        {"type": "response.created", "response": {"id": "resp_1", "created_at": 99}},
        {"type": "response.output_item.added", "item": {"id": item}},
        *({"type": "response.output_text.delta", "item_id": item, "delta": d} for d in deltas),
        {"type": "response.completed", "response": {"id": "resp_1", "output": [{"id": item}]}},
    ]


FIXED = {"id": "resp_1", "created_at": 1, "background": True}


def test_a_run_again_repeats_what_was_sent_and_goes_on_after_it_under_the_same_names() -> None:
    first = Splice([], FIXED)
    sent = [first.take(e) for e in run("msg_a", ["One", " two"])[:3]]
    assert [e["sequence_number"] for e in sent if e] == [0, 1, 2]
    assert sent[0] is not None and sent[0]["response"]["created_at"] == 1
    again = Splice([e for e in sent if e], FIXED)
    out = [again.take(e) for e in run("msg_b", ["One", " two", " three"])]
    assert out[:3] == [None, None, None]
    rest = [e for e in out if e]
    assert [e["sequence_number"] for e in rest] == [3, 4, 5]
    assert rest[0]["item_id"] == "msg_a" and rest[-1]["response"]["output"][0]["id"] == "msg_a"
    assert rest[-1]["response"]["background"] is True


def test_a_run_that_says_something_else_cannot_go_on() -> None:
    first = Splice([], FIXED)
    sent = [first.take(e) for e in run("msg_a", ["One", " two"])[:4]]
    again = Splice([e for e in sent if e], FIXED)
    with pytest.raises(Diverged):
        for event in run("msg_b", ["One", " three"]):
            again.take(event)
