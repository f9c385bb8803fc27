"""Request body -> vLLM SamplingParams, through vLLM's own request types (no engine)."""

from __future__ import annotations

from typing import Any

import pytest

from worker import sampling
from worker.errors import RequestError

MAX_MODEL_LEN = 8192


def params(
    kind: str, prompt_tokens: int = 5, defaults: dict[str, Any] | None = None, **body: Any
) -> Any:
    base = (
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        if kind == "chat"
        else {"model": "m", "prompt": "hi"}
    )
    request = sampling.parse_request(kind, {**base, **body})  # type: ignore[arg-type]
    return sampling.to_sampling_params(request, prompt_tokens, MAX_MODEL_LEN, defaults or {})


def test_openai_fields_map_onto_sampling_params() -> None:
    sp = params(
        "completion",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=3,
        stop=["\n", "."],
        seed=42,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        logprobs=2,
    )
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.n, sp.seed) == (7, 0.5, 0.9, 3, 42)
    assert sp.stop == ["\n", "."]
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.25, -0.5)
    assert sp.logprobs == 2


def test_vllm_extension_fields_map_too() -> None:
    sp = params(
        "completion",
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        min_tokens=3,
        ignore_eos=True,
        stop_token_ids=[7],
        max_tokens=10,
    )
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.min_tokens) == (5, 0.1, 1.2, 3)
    assert sp.ignore_eos is True and 7 in sp.stop_token_ids


def test_chat_prefers_max_completion_tokens() -> None:
    assert params("chat", max_tokens=50, max_completion_tokens=9).max_tokens == 9
    assert params("chat", max_tokens=50).max_tokens == 50


def test_chat_logprobs_use_top_logprobs() -> None:
    assert params("chat", logprobs=True, top_logprobs=3).logprobs == 3
    assert params("chat").logprobs is None


def test_without_max_tokens_the_rest_of_the_context_is_the_limit() -> None:
    assert params("chat", prompt_tokens=100).max_tokens == MAX_MODEL_LEN - 100


def test_completions_default_to_16_tokens_as_openai() -> None:
    assert params("completion").max_tokens == 16


def test_model_generation_config_supplies_defaults() -> None:
    sp = params("completion", defaults={"temperature": 0.3, "top_p": 0.8})
    assert (sp.temperature, sp.top_p) == (0.3, 0.8)
    assert params("completion", defaults={"temperature": 0.3}, temperature=1.0).temperature == 1.0


def test_streaming_asks_for_deltas_and_non_streaming_for_the_final_output() -> None:
    from vllm.sampling_params import RequestOutputKind

    assert params("chat", stream=True).output_kind == RequestOutputKind.DELTA
    assert params("chat").output_kind == RequestOutputKind.FINAL_ONLY


def test_a_prompt_that_fills_the_context_is_refused() -> None:
    with pytest.raises(RequestError) as info:
        params("completion", prompt_tokens=MAX_MODEL_LEN + 1)
    assert info.value.status == 400 and str(MAX_MODEL_LEN) in info.value.message


def test_greedy_with_several_choices_is_refused_as_vllm_does() -> None:
    with pytest.raises(RequestError) as info:
        params("completion", n=2, temperature=0)
    assert info.value.status == 400


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": "many"}, "max_tokens"),
    ],
)
def test_type_errors_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        params("completion", **body)
    assert info.value.status == 400 and info.value.param == param
