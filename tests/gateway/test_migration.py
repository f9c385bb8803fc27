"""Which streams may move to another worker mid-answer, and what they carry
(gateway/api/migration.py). A stream's move on real workers:
tests/faults/test_migration.py and tests/integration/test_two_workers.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway import errors
from gateway.api.migration import Seam, movable
from gateway.dispatch.handle import Answerer, RequestHandle, WorkerLost
from gateway.tracing import NO_SPAN
from shared import protocol

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True}


@pytest.mark.parametrize(
    ("kind", "extra", "moves"),
    [
        ("chat", {}, True),
        ("chat", {"temperature": 0.7, "seed": 3, "max_tokens": 9}, True),
        ("chat", {"response_format": {"type": "text"}}, True),
        ("chat", {"n": 2}, False),
        ("chat", {"logprobs": True, "top_logprobs": 2}, True),
        ("chat", {"prompt_logprobs": 1}, False),
        ("completion", {"prompt": "Once", "logprobs": 1}, True),
        ("chat", {"stop": ["\n"]}, True),
        ("chat", {"response_format": {"type": "json_object"}}, False),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, False),
        ("completion", {"prompt": "Once"}, True),
        ("completion", {"prompt": [1, 2, 3]}, True),
        ("completion", {"prompt": ["a", "b"]}, False),
        ("completion", {"prompt": "Once", "echo": True}, False),
        ("completion", {"prompt": "Once", "best_of": 2}, False),
        ("vllm", {}, False),
    ],
)
def test_what_may_move(kind: protocol.RequestKind, extra: dict[str, Any], moves: bool) -> None:
    assert movable(kind, {**CHAT, **extra}) is moves


def handle(address: str, closed: list[str]) -> RequestHandle:
    answerer = Answerer(address, "i", "m", "", None, False)
    made, _ = RequestHandle.open("r", answerer, lambda: closed.append(address))
    return made


def delta(ids: list[int], text: str = "x", finish: str | None = None) -> protocol.Delta:
    return protocol.Delta("r", 0, text, len(ids), finish_reason=finish, token_ids=ids)


class Resumes:
    """The next workers a seam asks for, and what it asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[list[int], str]] = []
        # The characters of text each move said were sent.
        self.sent: list[int] = []
        self.closed: list[str] = []

    async def __call__(
        self, continuation: protocol.Continuation, failed: str
    ) -> tuple[RequestHandle, Any]:
        self.asked.append((list(continuation.token_ids), failed))
        self.sent.append(continuation.sent_chars)
        return handle(f"w{len(self.asked)}", self.closed), delta([99])


def move(seam: Seam, failure: Any, on: RequestHandle) -> Any:
    return asyncio.run(seam.move(failure, on, NO_SPAN, {}))


def test_a_lost_worker_s_stream_moves_with_its_tokens() -> None:
    resumes = Resumes()
    seam = Seam(2, resumes)
    first = handle("w0", resumes.closed)
    seam.add(protocol.Delta("r", 0, "Once", 2, prompt_tokens=7, token_ids=[5, 6]))
    seam.add(delta([7]))
    moved = move(seam, WorkerLost("gone"), first)
    assert moved is not None
    assert resumes.asked == [([5, 6, 7], "w0")]
    assert resumes.sent == [len("Oncex")]  # the next worker sends what was held back
    assert resumes.closed == ["w0"]  # the failed attempt let go of
    second, first_delta = moved
    assert first_delta.token_ids == [99]
    # Cut now, it is billed the carried tokens and what the next worker counted.
    second._inbox.deliver(protocol.Delta("r", 0, "x", 1, prompt_tokens=7, token_ids=[99]))
    assert seam.computed(second) == protocol.Usage(7, 4)


def test_tokens_whose_text_was_held_back_are_generated_again() -> None:
    resumes = Resumes()
    seam = Seam(2, resumes)
    seam.add(delta([5, 6]))
    seam.add(delta([7], text=""))  # the first bytes of a character: no text yet
    move(seam, WorkerLost("gone"), handle("w0", resumes.closed))
    assert resumes.asked == [([5, 6], "w0")]


def scored(ids: list[int], text: str = "x") -> protocol.Delta:
    logprobs = [protocol.TokenLogprob(text, -1.0, token_id=i) for i in ids]
    return protocol.Delta("r", 0, text, len(ids), token_ids=ids, logprobs=logprobs)


def test_a_stream_with_logprobs_moves_unless_their_entries_for_held_tokens_went_out() -> None:
    resumes = Resumes()
    seam = Seam(2, resumes)
    seam.add(scored([5, 6]))
    assert move(seam, WorkerLost("gone"), handle("w0", resumes.closed)) is not None
    assert resumes.asked == [([5, 6], "w0")]
    held = Seam(2, resumes)
    held.add(scored([5, 6]))
    held.add(scored([7], text=""))  # scored and sent, its text held back
    assert move(held, WorkerLost("gone"), handle("w1", resumes.closed)) is None


def test_a_stream_moves_at_most_its_limit_and_only_for_a_worker_s_fault() -> None:
    resumes = Resumes()
    seam = Seam(1, resumes)
    seam.add(delta([5]))
    # A refusal of the request itself is the client's answer, not a move.
    refused = protocol.Failed("r", 400, "bad")
    assert move(seam, refused, handle("w0", resumes.closed)) is None
    draining = protocol.Failed("r", 503, "draining", cause=protocol.WORKER_DRAINING)
    moved = move(seam, draining, handle("w0", resumes.closed))
    assert moved is not None
    assert move(seam, WorkerLost("gone"), moved[0]) is None  # its one move is spent
    assert len(resumes.asked) == 1


def test_a_worker_that_sends_no_token_ids_keeps_its_streams() -> None:
    resumes = Resumes()
    seam = Seam(2, resumes)
    seam.add(protocol.Delta("r", 0, "x", 1))
    assert move(seam, WorkerLost("gone"), handle("w0", resumes.closed)) is None


def test_a_stream_whole_but_for_its_usage_ends_where_it_is() -> None:
    resumes = Resumes()
    seam = Seam(2, resumes)
    seam.add(protocol.Delta("r", 0, "a", 2, prompt_tokens=7, token_ids=[5, 6]))
    seam.add(delta([7], finish="length"))
    moved = move(seam, WorkerLost("gone"), handle("w0", resumes.closed))
    assert moved is not None and moved[1].usage == protocol.Usage(7, 3)
    assert resumes.asked == []


def test_a_move_that_finds_no_worker_raises_its_error() -> None:
    async def nowhere(continuation: protocol.Continuation, failed: str) -> Any:
        raise errors.NoWorker("No worker is available.")

    seam = Seam(2, nowhere)
    seam.add(delta([5]))
    with pytest.raises(errors.NoWorker):
        move(seam, WorkerLost("gone"), handle("w0", []))


def test_a_worker_dropping_a_quiet_gateway_s_stream_may_take_it_again() -> None:
    resumes = Resumes()
    seam = Seam(2, resumes)
    seam.add(delta([5]))
    silent = protocol.Failed("r", 503, "silent", cause=protocol.GATEWAY_SILENT)
    assert move(seam, silent, handle("w0", resumes.closed)) is not None
    assert resumes.asked == [([5], "")]  # no worker avoided
