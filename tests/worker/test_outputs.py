"""worker.outputs: engine outputs become deltas (no engine: outputs shaped as vLLM's)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from shared import protocol
from worker.outputs import RequestDeltas, token_logprobs
from worker.prepare import PreparedPrompt


def prompt(n: int = 1, echo: str | None = None, key_prompts: dict[str, str] | None = None) -> Any:
    params = SimpleNamespace(n=n, logprobs=None)
    return PreparedPrompt(None, params, prompt_tokens=3, echo_text=echo, key_prompts=key_prompts)


def output(*choices: tuple[int, str, str | None]) -> Any:
    """A ``RequestOutput``: (choice index, text, finish reason) per choice, one token each."""
    return SimpleNamespace(
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=None,
        outputs=[
            SimpleNamespace(
                index=index,
                text=text,
                token_ids=[7],
                logprobs=None,
                finish_reason=finish,
                stop_reason=None,
            )
            for index, text, finish in choices
        ],
    )


def test_choices_are_numbered_across_prompts_and_usage_counts_them_all() -> None:
    deltas = RequestDeltas("r", [prompt(n=2), prompt(n=2)], tokenizer=None, special_ids=frozenset())
    first = deltas.step(1, output((0, "a", None), (1, "b", None)))
    assert [d.index for d in first] == [2, 3]
    deltas.step(0, output((1, "c", "stop")))
    (last,) = deltas.usage()
    assert last.usage == protocol.Usage(prompt_tokens=6, completion_tokens=3)


def test_the_prompt_is_echoed_once_per_choice() -> None:
    deltas = RequestDeltas("r", [prompt(echo="hi")], tokenizer=None, special_ids=frozenset())
    (first,) = deltas.step(0, output((0, "a", None)))
    (second,) = deltas.step(0, output((0, "b", "length")))
    assert (first.echo, first.prompt_token_ids) == ("hi", [1, 2, 3])
    assert second.echo is None and second.prompt_token_ids is None


def test_prompted_keys_are_plain_in_the_deltas_even_when_split() -> None:
    keys = {'"a (why)"': '"a"'}
    deltas = RequestDeltas("r", [prompt(key_prompts=keys)], tokenizer=None, special_ids=frozenset())
    texts = [
        deltas.step(0, output((0, text, finish)))[0].text
        for text, finish in [('{"a (w', None), ('hy)": 1}', "stop")]
    ]
    assert "".join(texts) == '{"a": 1}'


def test_token_logprobs_are_ranked_and_clamped_as_vllms_server_does() -> None:
    step = {
        5: SimpleNamespace(logprob=-0.5, rank=2, decoded_token="b"),
        4: SimpleNamespace(logprob=float("-inf"), rank=1, decoded_token=None),
    }
    (scored,) = token_logprobs([4], [step], special_ids=frozenset({4}))
    assert (scored.token, scored.logprob, scored.special, scored.rank) == (
        "token_id:4",
        -9999.0,
        True,
        1,
    )
    assert [(t.token_id, t.logprob) for t in scored.top] == [(4, -9999.0), (5, -0.5)]
