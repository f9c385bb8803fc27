"""vLLM's own routes through llmgate (gateway.api.vllm_routes -> worker.vllm_app),
with the real engine: the Responses API through the OpenAI SDK, vLLM's extra
routes, and chat/completion fields only vLLM's server answers. Field-by-field
equality with ``vllm serve`` is tests/integration/test_parity.py's."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.conftest import MODEL, Served


@pytest.fixture(scope="module")
def client(served: Served) -> OpenAI:
    return OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)


def test_the_responses_api_answers_through_the_sdk(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="What is the capital of France?", max_output_tokens=16, temperature=0
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert "Paris" in response.output_text
    assert response.usage is not None and response.usage.output_tokens > 0


def test_the_responses_api_streams_its_events(client: OpenAI) -> None:
    with client.responses.stream(
        model=MODEL, input="What is the capital of France?", max_output_tokens=16, temperature=0
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    assert events[0] == "response.created" and events[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert "response.output_text.delta" in events
    assert "Paris" in final.output_text


def test_tokenize_and_detokenize_round_trip(served: Served) -> None:
    tokens = httpx.post(
        f"{served.base_url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}, timeout=60
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    text = httpx.post(
        f"{served.base_url}/detokenize",
        json={"model": MODEL, "tokens": tokens["tokens"]},
        timeout=60,
    ).json()
    assert text == {"prompt": "Hello world"}


def test_version_and_ping(served: Served) -> None:
    version = httpx.get(f"{served.base_url}/version", timeout=60)
    assert version.status_code == 200 and version.json()["version"].count(".") >= 2
    assert httpx.get(f"{served.base_url}/ping", timeout=60).status_code == 200
    assert httpx.post(f"{served.base_url}/ping", timeout=60).status_code == 200


def test_prompt_logprobs_and_token_ids_come_back(served: Served) -> None:
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 3,
        "temperature": 0,
        "prompt_logprobs": 1,
        "return_token_ids": True,
    }
    choice = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=60).json()[
        "choices"
    ][0]
    prompt_ids = choice["prompt_token_ids"]
    # One entry per prompt token, the first unscored (null), as vLLM answers.
    assert len(choice["prompt_logprobs"]) == len(prompt_ids) > 1
    assert choice["prompt_logprobs"][0] is None and all(choice["prompt_logprobs"][1:])
    assert len(choice["token_ids"]) == 3


def test_continuous_usage_stats_put_usage_in_every_chunk(served: Served) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{served.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    import json

    chunks = [json.loads(e) for e in events]
    assert chunks and all(c.get("usage") for c in chunks), chunks
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_a_vllm_error_keeps_its_status_and_openai_shape(served: Served) -> None:
    # vLLM's server judges a tool choice that names no tool: its 400 comes through.
    response = httpx.post(
        f"{served.base_url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ],
            "tool_choice": {"type": "function", "function": {"name": "not_a_tool"}},
        },
        timeout=60,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "does not match" in error["message"]


def test_an_unknown_model_is_404_on_vllm_routes_too(served: Served) -> None:
    response = httpx.post(
        f"{served.base_url}/tokenize", json={"model": "no-such-model", "prompt": "x"}, timeout=60
    )
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"
