"""gateway/cascade.py: when the cheap answer is kept."""

from __future__ import annotations

from gateway import cascade, sse
from shared import protocol


def answer(text: str, logprobs: list[float]) -> sse.Completion:
    builder = sse.Completion("r", "auto", 1, None)
    tokens = [protocol.TokenLogprob(token="t", logprob=v) for v in logprobs]
    builder.add(protocol.Delta("r", 0, text, len(tokens), logprobs=tokens))
    return builder


def test_logprobs_are_asked_for_without_changing_what_the_client_asked() -> None:
    assert cascade.with_logprobs("completion", {"prompt": "x"})["logprobs"] == 0
    assert cascade.with_logprobs("completion", {"logprobs": 3})["logprobs"] == 3
    assert cascade.with_logprobs("chat", {"messages": []})["logprobs"] is True
    raw = {"prompt": "x"}
    cascade.with_logprobs("completion", raw)
    assert "logprobs" not in raw  # a copy


def test_a_confident_answer_is_kept_and_an_unsure_one_is_not() -> None:
    assert cascade.shortfall(answer("Paris", [-0.1, -0.3]), {}, -1.0) is None
    assert cascade.shortfall(answer("Lyon", [-0.5, -2.5]), {}, -1.0) == "low_confidence"
    assert cascade.mean_logprob(answer("", [])) is None


def test_json_that_does_not_parse_escalates_whatever_its_confidence() -> None:
    wants_json = {"response_format": {"type": "json_object"}}
    assert cascade.shortfall(answer('{"a": 1}', [-0.1]), wants_json, -1.0) is None
    assert cascade.shortfall(answer('{"a": ', [-0.1]), wants_json, -1.0) == "invalid_json"
