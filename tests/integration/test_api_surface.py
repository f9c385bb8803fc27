"""More of the OpenAI/vLLM API against the real worker: structured outputs, echo, limits.

Structured outputs go through vLLM's own backends (the gateway forwards
``response_format`` and ``structured_outputs`` untouched); the limits are
the session worker's ``--max-input-tokens 4000 --max-total-tokens 6000``
and the gateway's ``--max-body-bytes``.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from tests.conftest import MODEL, Served

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(served: Served) -> Tokenizer:
    """The session model's tokenizer.json, read by the tokenizers library
    (the fast tokenizer vLLM's wraps): importing transformers for it cost the
    integration session 20-27 s of its critical path."""
    return Tokenizer.from_file(str(Path(served.model_dir) / "tokenizer.json"))


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        },
    )
    jsonschema.validate(json.loads(response.choices[0].message.content or ""), PERSON)


def test_json_object_output_parses(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": 'Reply with the JSON object {"animal": "cat"}.'}],
        max_tokens=300,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content or ""), dict)


def test_regex_output_matches(client: openai.OpenAI) -> None:
    pattern = r"[0-9]{3}-[0-9]{4}"
    response = client.completions.create(
        model=MODEL,
        prompt="Phone number:",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, response.choices[0].text)


def test_choice_output_is_one_of_the_choices(client: openai.OpenAI) -> None:
    choices = ["red", "green", "blue"]
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert response.choices[0].message.content in choices


@pytest.mark.parametrize("structured", [{"regex": "[0-9"}, {"json": {"type": "no-such-type"}}])
def test_an_invalid_constraint_is_400_and_the_worker_lives_on(
    client: openai.OpenAI, structured: dict
) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=5, extra_body={"structured_outputs": structured}
        )
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_echo_returns_the_prompt_then_the_completion(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    chunks = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_tokens_too(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    prompt = "The capital of France is"
    prompt_tokens = len(tokenizer.encode(prompt).ids)
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    logprobs = echoed.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert len(logprobs.tokens) == prompt_tokens + 3
    assert "".join(logprobs.tokens) == echoed.choices[0].text
    # The first prompt token has nothing before it to be scored by: null, as OpenAI says.
    assert logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    chunks = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens or []
    ]
    assert streamed == logprobs.tokens


def test_echo_of_token_ids_decodes_them(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello there, friend", add_special_tokens=False).ids
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    echoed = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True
    )
    assert echoed.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text


def test_content_parts_are_rendered_like_plain_text(client: openai.OpenAI) -> None:
    question = "What is the capital of France?"
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=10, temperature=0
    )
    parts = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": question}]}],
        max_tokens=10,
        temperature=0,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_a_prompt_over_max_input_tokens_is_400_naming_the_limit(
    client: openai.OpenAI, served: Served
) -> None:
    rid = f"over-the-limit-{time.time_ns()}"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt=[1] * 4001, max_tokens=1, extra_headers={"X-Request-Id": rid}
        )
    assert "--max-input-tokens of 4000" in info.value.message
    assert "4001" in info.value.message
    # The worker and the gateway both log why it ended. Each line reaches the
    # session's log through `llmgate serve`, which relays each child's output
    # on a thread of its own: in either order, whatever order they were written.
    why = f"400 {info.value.body['message']} [request_id={rid}]"  # type: ignore[index]
    served.wait_for_log(f"gateway.api.attempts: the worker failed the request: {why}", 30)
    served.wait_for_log(f"worker.server: request refused: {why}", 30)


def test_prompt_plus_max_tokens_over_max_total_tokens_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1] * 3000, max_tokens=3500)
    assert "--max-total-tokens of 6000" in info.value.message
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_n_over_max_n_is_400_naming_the_limit(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=129, max_tokens=1
        )
    assert "n is 129" in info.value.message
    assert "--max-n of 128" in info.value.message
    assert info.value.body["param"] == "n"  # type: ignore[index]


def test_too_many_stop_sequences_is_400_naming_the_limit(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="Hi", stop=[str(i) for i in range(17)], max_tokens=1
        )
    assert "stop has 17 sequences" in info.value.message
    assert "--max-stop-sequences of 16" in info.value.message


def test_a_declared_oversized_body_is_413_before_it_is_sent(served: Served) -> None:
    host, port = served.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
        )
        reply = sock.recv(4096).decode()
    # Answered before a byte of the body was sent. (The JSON body may come in
    # a later segment; its text is checked in the chunked test below.)
    assert reply.startswith("HTTP/1.1 413")
    assert "content-type: application/json" in reply.lower()


def test_a_streamed_oversized_body_is_413(served: Served) -> None:
    def body():  # type: ignore[no-untyped-def]  # chunked: no Content-Length
        for _ in range(17):
            yield b" " * (1024 * 1024)

    response = httpx.post(
        f"{served.base_url}/v1/completions",
        content=body(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 413
    assert response.json()["error"]["message"].startswith("The request body is larger")


@pytest.mark.parametrize(
    "extra",
    [{"prompt": [-(2**63) - 1]}, {"prompt": [2**40]}, {"seed": 2**70}, {"unknown": 10**30}],
)
def test_integers_out_of_range_are_400_not_500(served: Served, extra: dict[str, object]) -> None:
    # Found by the fuzz test: msgpack stops at 64 bits and JSON does not.
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **extra}
    response = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
