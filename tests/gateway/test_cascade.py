"""gateway/dispatch/cascade.py: when the cheap answer is kept."""

from __future__ import annotations

from typing import Any

from gateway.dialects import sse
from gateway.dispatch import cascade
from gateway.dispatch.models import Target, Tier
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


# -- the loop: cascade.run over the caller's attempts ---------------------------

BIG = Target("big", (Tier("gpu", "big"),))
CHEAP = Target(
    "cheap", (Tier("cpu", "cheap"),), rule="default", escalate_to=BIG, min_mean_logprob=-1.0
)


class Runs:
    """The caller's attempts: each run answers with the next of ``answers``."""

    def __init__(self, builder: sse.Completion, *answers: tuple[str, float]) -> None:
        self.builder = builder
        self.answers = list(answers)
        self.runs: list[tuple[Target, dict[str, Any]]] = []
        self.forgotten = 0

    async def run(self, target: Target, raw: dict[str, Any]) -> str:
        self.runs.append((target, raw))
        text, logprob = self.answers.pop(0)
        token = protocol.TokenLogprob(token=text, logprob=logprob)
        self.builder.add(protocol.Delta("r", 0, text, 1, logprobs=[token]))
        return f"answered by {target.model}"

    def forget_output(self) -> None:
        self.forgotten += 1
        self.builder.reset()


async def test_a_good_enough_cheap_answer_is_kept_after_one_run() -> None:
    builder = sse.Completion("r", "auto", 1, None)
    runs = Runs(builder, ("Paris", -0.1))
    raw = {"prompt": "Capital of France?"}
    answer, outcome = await cascade.run(CHEAP, "completion", raw, builder, runs)
    assert (answer, outcome) == ("answered by cheap", "accepted")
    assert runs.runs == [(CHEAP, {**raw, "logprobs": 0})] and runs.forgotten == 0


async def test_an_unsure_answer_is_forgotten_and_the_escalation_target_answers() -> None:
    builder = sse.Completion("r", "auto", 1, None)
    runs = Runs(builder, ("Lyon", -3.0), ("Paris", -0.1))
    raw = {"prompt": "Capital of France?"}
    answer, outcome = await cascade.run(CHEAP, "completion", raw, builder, runs)
    assert (answer, outcome) == ("answered by big", "escalated")
    assert runs.forgotten == 1 and "".join(builder.choices[0].text) == "Paris"
    (_, first), (escalated, second) = runs.runs
    assert first["logprobs"] == 0 and second is raw  # the client's own request
    # The escalation keeps the auto rule that chose the cheap model.
    assert escalated == Target("big", BIG.tiers, rule="default")


def test_only_our_own_answers_to_an_escalating_target_are_cascaded() -> None:
    assert cascade.applies(CHEAP, "completion") and cascade.applies(CHEAP, "chat")
    assert not cascade.applies(CHEAP, "vllm")
    assert not cascade.applies(BIG, "completion")
