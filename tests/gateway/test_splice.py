"""gateway/background/splice.py: a run again goes on after the events sent, or says it cannot."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.background.kinds import ChunksKind, ResponsesKind
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
    first = Splice(ResponsesKind(), [], FIXED)
    sent = [first.take(e) for e in run("msg_a", ["One", " two"])[:3]]
    assert [e["sequence_number"] for e in sent if e] == [0, 1, 2]
    assert sent[0] is not None and sent[0]["response"]["created_at"] == 1
    again = Splice(ResponsesKind(), [e for e in sent if e], FIXED)
    out = [again.take(e) for e in run("msg_b", ["One", " two", " three"])]
    assert out[:3] == [None, None, None]
    rest = [e for e in out if e]
    assert [e["sequence_number"] for e in rest] == [3, 4, 5]
    assert rest[0]["item_id"] == "msg_a" and rest[-1]["response"]["output"][0]["id"] == "msg_a"
    assert rest[-1]["response"]["background"] is True


def test_a_run_that_says_something_else_cannot_go_on() -> None:
    first = Splice(ResponsesKind(), [], FIXED)
    sent = [first.take(e) for e in run("msg_a", ["One", " two"])[:4]]
    again = Splice(ResponsesKind(), [e for e in sent if e], FIXED)
    with pytest.raises(Diverged):
        for event in run("msg_b", ["One", " three"]):
            again.take(event)


def chunk(text: str, created: int) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    return {"id": "chatcmpl-1", "created": created, "choices": [choice]}


def test_chat_chunks_keep_the_first_runs_created_and_must_repeat_its_text() -> None:
    first = Splice(ChunksKind(), [], {})
    sent = [first.take(chunk(t, 1)) for t in ("One", " two")]
    again = Splice(ChunksKind(), [e for e in sent if e], {"created": 1})
    out = [again.take(chunk(t, 5)) for t in ("One", " two", " three")]
    assert out[:2] == [None, None] and out[2] == chunk(" three", 1)
    with pytest.raises(Diverged):
        Splice(ChunksKind(), [e for e in sent if e], {"created": 1}).take(chunk("Two", 5))
