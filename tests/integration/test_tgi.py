"""TGI's generate API against the real worker: seed 004's request, TGI's own client, shapes.

The client is ``text_generation`` (TGI's Python client, the one of seed
004's era): it posts to ``/`` and parses TGI's response and stream types
with pydantic, so a shape we get wrong fails here.
"""

from __future__ import annotations

import json

import httpx
import pytest
import text_generation
from text_generation.errors import ValidationError

from tests.conftest import MODEL

COUNTING = "Count with me: 1, 2, 3,"

# The body of seed 004's curl line, field for field.
SEED_004 = {
    "inputs": "Hello World, what is your name dog?",
    "parameters": {
        "max_new_tokens": 10,
        "do_sample": False,
        "best_of": None,
        "repetition_penalty": 1,
        "return_full_text": False,
        "seed": None,
        "stop_sequences": None,
        "temperature": 0.1,
        "top_k": 100,
        "top_p": 0.3,
        "truncate": None,
        "typical_p": None,
        "watermark": False,
        "decoder_input_details": False,
    },
}


@pytest.fixture(scope="module")
def client(base_url: str) -> text_generation.Client:
    return text_generation.Client(base_url, timeout=120)


def generate(base_url: str, body: dict[str, object], path: str = "/generate") -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=120)


def stream_events(base_url: str, body: dict[str, object]) -> list[dict[str, object]]:
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data:") for line in lines), lines
    assert "data: [DONE]" not in lines  # TGI streams end without a marker
    return [json.loads(line.removeprefix("data:")) for line in lines]


def test_seed_004_request_works_unchanged(base_url: str) -> None:
    response = generate(base_url, SEED_004)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"generated_text"}  # details only when asked for
    assert body["generated_text"].strip()


def test_greedy_generate_matches_the_completions_endpoint(base_url: str) -> None:
    tgi = generate(base_url, {"inputs": COUNTING, "parameters": {"max_new_tokens": 8}})
    openai = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": COUNTING, "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert tgi.json()["generated_text"] == openai.json()["choices"][0]["text"]


def test_details_describe_every_generated_token(base_url: str) -> None:
    response = generate(
        base_url,
        {"inputs": COUNTING, "parameters": {"max_new_tokens": 6, "details": True}},
    )
    body = response.json()
    details = body["details"]
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == 6
    assert details["seed"] is None  # greedy
    assert details["prefill"] == []
    tokens = details["tokens"]
    assert len(tokens) == 6
    assert all(isinstance(t["id"], int) and t["id"] >= 0 and t["logprob"] <= 0 for t in tokens)
    assert "".join(t["text"] for t in tokens) == body["generated_text"]


def test_stop_sequence_ends_generation(base_url: str) -> None:
    response = generate(
        base_url,
        {
            "inputs": COUNTING,
            "parameters": {"max_new_tokens": 40, "stop": [" 6"], "details": True},
        },
    )
    body = response.json()
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert " 6" not in body["generated_text"]
    assert body["generated_text"].startswith(" 4, 5,")


def test_return_full_text_prepends_the_prompt(base_url: str) -> None:
    plain = generate(base_url, {"inputs": COUNTING, "parameters": {"max_new_tokens": 4}})
    full = generate(
        base_url,
        {"inputs": COUNTING, "parameters": {"max_new_tokens": 4, "return_full_text": True}},
    )
    assert full.json()["generated_text"] == COUNTING + plain.json()["generated_text"]


def test_sampling_with_a_seed_repeats_and_reports_it(base_url: str) -> None:
    body = {
        "inputs": "Once upon a time",
        "parameters": {"max_new_tokens": 12, "do_sample": True, "seed": 7, "details": True},
    }
    first, second = generate(base_url, body).json(), generate(base_url, body).json()
    assert first["generated_text"] == second["generated_text"]
    assert first["details"]["seed"] == 7
    unseeded = {"inputs": "Once upon a time", "parameters": {"do_sample": True, "details": True}}
    assert isinstance(generate(base_url, unseeded).json()["details"]["seed"], int)


def test_stream_is_one_event_per_token_and_ends_with_the_text(base_url: str) -> None:
    body = {"inputs": COUNTING, "parameters": {"max_new_tokens": 5, "details": True}}
    events = stream_events(base_url, body)
    assert [e["index"] for e in events] == [1, 2, 3, 4, 5]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == generate(base_url, body).json()["generated_text"]
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 5, "seed": None}
    assert "".join(e["token"]["text"] for e in events) == last["generated_text"]


def test_top_n_tokens_lists_alternatives(base_url: str) -> None:
    body = {"inputs": COUNTING, "parameters": {"max_new_tokens": 3, "top_n_tokens": 2}}
    events = stream_events(base_url, body)
    for e in events:
        top = e["top_tokens"]
        assert len(top) == 2
        assert top[0]["logprob"] >= top[1]["logprob"]
        # Greedy: the chosen token is the most likely one.
        assert top[0]["id"] == e["token"]["id"]


def test_tgi_client_generate_and_stream(client: text_generation.Client) -> None:
    response = client.generate(COUNTING, max_new_tokens=5)  # it always asks for details
    assert response.details.generated_tokens == 5
    assert response.details.finish_reason.value == "length"
    streamed = list(client.generate_stream(COUNTING, max_new_tokens=5))
    assert len(streamed) == 5
    assert streamed[-1].generated_text == response.generated_text


def test_compat_route_answers_a_list(base_url: str) -> None:
    response = generate(base_url, {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, path="/")
    assert isinstance(response.json(), list)
    assert set(response.json()[0]) == {"generated_text"}


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        ({"temperature": 0}, "temperature"),
        ({"typical_p": 0.5}, "typical_p"),
        ({"watermark": True}, "watermark"),
        ({"max_new_tokens": "many"}, "max_new_tokens"),
        ({"stop": ["a"] * 17}, "max-stop-sequences"),
    ],
)
def test_bad_parameters_get_tgi_validation_errors(
    base_url: str, parameters: dict[str, object], named: str
) -> None:
    response = generate(base_url, {"inputs": "Hi", "parameters": parameters})
    assert response.status_code == 422
    body = response.json()
    assert body["error_type"] == "validation"
    assert named in body["error"]


def test_decoder_input_details_score_the_prompt_as_the_completions_echo_does(
    base_url: str, client: text_generation.Client
) -> None:
    parameters = {"max_new_tokens": 4, "details": True, "decoder_input_details": True}
    response = generate(base_url, {"inputs": COUNTING, "parameters": parameters})
    assert response.status_code == 200, response.text
    body = response.json()
    prefill = body["details"]["prefill"]
    echo = httpx.post(
        f"{base_url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": COUNTING,
            "max_tokens": 4,
            "temperature": 0,
            "echo": True,
            "logprobs": 0,
        },
        timeout=120,
    ).json()["choices"][0]
    prompt_tokens = len(prefill)
    assert prompt_tokens > 1
    # The prompt's tokens, their texts and scores: the first one unscored.
    assert [t["text"] for t in prefill] == echo["logprobs"]["tokens"][:prompt_tokens]
    assert [t["logprob"] for t in prefill] == echo["logprobs"]["token_logprobs"][:prompt_tokens]
    assert prefill[0]["logprob"] is None
    assert all(isinstance(t["id"], int) for t in prefill)
    # The generated text is only what was generated, not the echoed prompt.
    assert body["generated_text"] == echo["text"][len(COUNTING) :]
    assert len(body["details"]["tokens"]) == 4
    # TGI's own client parses it (its InputToken allows a null logprob).
    details = client.generate(COUNTING, max_new_tokens=4, decoder_input_details=True).details
    assert [t.text for t in details.prefill] == [t["text"] for t in prefill]


def test_decoder_input_details_are_refused_when_streaming(base_url: str) -> None:
    response = httpx.post(
        f"{base_url}/generate_stream",
        json={"inputs": "Hi", "parameters": {"details": True, "decoder_input_details": True}},
        timeout=120,
    )
    assert response.status_code == 422
    assert "decoder_input_details" in response.json()["error"]


def test_empty_inputs_are_refused(base_url: str, client: text_generation.Client) -> None:
    assert generate(base_url, {"inputs": ""}).status_code == 422
    with pytest.raises(ValidationError):
        client.generate("x", max_new_tokens=100_000)


def test_a_prompt_over_the_input_limit_is_a_validation_error(base_url: str) -> None:
    response = generate(base_url, {"inputs": "word " * 5000, "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 422
    assert "--max-input-tokens" in response.json()["error"]
