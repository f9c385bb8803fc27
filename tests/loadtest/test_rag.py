"""``loadtest.rag``'s parts on made-up figures; the measuring is a run of
``make bench ARGS="--scenario rag"``, not a test."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from loadtest import rag
from loadtest.rag import Answer
from shared.embedded import default_model_dir


def test_every_question_is_asked_once_in_the_same_order() -> None:
    pairs = rag.order(5, 3)
    assert sorted(pairs) == [(d, q) for d in range(5) for q in range(3)]
    assert pairs == rag.order(5, 3)
    assert pairs != sorted(pairs)  # shuffled: a document's questions do not come together


def test_the_floor_computes_each_documents_shared_blocks_once() -> None:
    answers = [
        Answer(0, 0, 1.0, prompt_tokens=500, worker="w0"),
        Answer(0, 1, 1.0, prompt_tokens=510, worker="w1"),
        Answer(0, 2, 1.0, prompt_tokens=505, worker="w0"),
        Answer(1, 0, 2.0, prompt_tokens=300, worker="w1"),
        Answer(1, 1, 0.0, error="HTTP 503"),
    ]
    result = rag.summarize("kv", answers, 10.0, 1_000.0, {0: 480, 1: 288})
    assert result.prompt_tokens == 1_815
    # Document 0 asked 3 times: its 480 shared tokens computed once, not 3 times.
    assert result.floor_tokens == 1_815 - 2 * 480
    assert result.against_floor == pytest.approx(1_000 / 855)
    assert (result.requests, result.errors) == (4, 1)
    assert result.requests_per_worker == {"w0": 2, "w1": 2}
    assert result.least_share == pytest.approx(0.5)


def test_verdicts_read_the_kv_runs_against_the_targets() -> None:
    ok = [Answer(0, q, 1.0, prompt_tokens=100, worker=f"w{q % 2}") for q in range(10)]
    kv = rag.summarize("kv", ok, 1.0, 600.0, {0: 0})
    kv.against_round_robin = 0.6
    lopsided = rag.summarize("kv@2", ok[:1] * 9 + ok[1:2], 1.0, 600.0, {0: 0})
    lopsided.against_round_robin = 0.6
    lines = rag.verdicts([kv, lopsided])
    assert lines[0].endswith(": met") and "0.60x" in lines[0]
    assert lines[1].endswith("NOT met")  # one worker took 90%


def test_shared_tokens_are_the_documents_whole_blocks() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    shared = rag.shared_tokens(tokenizer, "t", 3, 200, 16)
    whole = len(rag.prompt_ids(tokenizer, rag.messages("t", 3, 0, 200)))
    assert shared % 16 == 0 and 200 < shared < whole
