"""Request bodies: what the gateway refuses before any worker sees it, and how."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway import errors
from gateway.dialects import schemas
from shared.settings import HttpSettings


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_every_openai_prompt_form_is_accepted(prompt: Any) -> None:
    assert schemas.validate(completion(prompt=prompt), schemas.CompletionRequest).prompt == prompt


@pytest.mark.parametrize("prompt", [[], ["a", 1], [[1], "b"], [[]], 5, None])
def test_bad_prompts_are_refused(prompt: Any) -> None:
    with pytest.raises(errors.BadRequest):
        schemas.validate(completion(prompt=prompt), schemas.CompletionRequest)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", "ten"),
        ("temperature", -1),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("n", 0),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("stop", 5),
        ("stream", "yes"),
        ("logprobs", 50),
        ("seed", 1.5),
    ],
)
def test_bad_fields_name_themselves(field: str, value: Any) -> None:
    with pytest.raises(errors.BadRequest) as info:
        schemas.validate(completion(**{field: value}), schemas.CompletionRequest)
    assert info.value.param == field
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"n": 9}, "n", "n is 9, more than this server's --max-n of 8."),
        ({"stop": ["a", "b", "c"]}, "stop", "stop has 3 sequences"),
    ],
)
def test_limits_name_the_limit_and_the_value(fields: Any, param: str, says: str) -> None:
    settings = HttpSettings(max_n=8, max_stop_sequences=2)
    body = schemas.validate(completion(**fields), schemas.CompletionRequest)
    with pytest.raises(errors.BadRequest) as info:
        schemas.check_limits(body, settings)
    assert info.value.param == param
    assert says in info.value.message


def test_requests_within_the_limits_pass() -> None:
    settings = HttpSettings(max_n=8, max_stop_sequences=2)
    body = schemas.validate(completion(n=8, stop=["a", "b"]), schemas.CompletionRequest)
    schemas.check_limits(body, settings)
    schemas.check_limits(
        schemas.validate(completion(stop="a"), schemas.CompletionRequest), settings
    )


def test_unknown_fields_are_ignored() -> None:
    body = schemas.validate(completion(whatever={"x": 1}), schemas.CompletionRequest)
    assert body.model == "m"


def test_missing_model_is_refused() -> None:
    with pytest.raises(errors.BadRequest, match="model"):
        schemas.validate({"prompt": "hi"}, schemas.CompletionRequest)


@pytest.mark.parametrize(
    "messages", [[], "hi", [{"content": "hi"}], [{"role": 5, "content": "hi"}]]
)
def test_bad_messages_are_refused(messages: Any) -> None:
    with pytest.raises(errors.BadRequest):
        schemas.validate(chat(messages=messages), schemas.ChatCompletionRequest)


@pytest.mark.parametrize("content", ["what is 1+1?", [{"type": "text", "text": "what is 1+1?"}]])
def test_a_custom_role_is_accepted_as_vllm_accepts_it(content: Any) -> None:
    # vLLM's server takes any string role and hands it to the chat template;
    # the gateway once refused it ("Invalid enum value").
    messages = [{"role": "my-custom-role", "content": content}]
    body = schemas.validate(chat(messages=messages), schemas.ChatCompletionRequest)
    assert body.messages[0].role == "my-custom-role"


# vLLM 0.32's answer, word for word (its validation_exception_handler over
# pydantic's error for `seed: int = Field(ge=-(2**63), le=2**63 - 1)`).
SEED_TOO_BIG = (
    "1 validation error:\n  {'type': 'less_than_equal', 'loc': 'body.seed', "
    "'msg': 'Input should be less than or equal to 9223372036854775807', "
    "'input': '9223372036854775808', 'ctx': {'le': 9223372036854775807}}"
)
SEED_TOO_SMALL = (
    "1 validation error:\n  {'type': 'greater_than_equal', 'loc': 'body.seed', "
    "'msg': 'Input should be greater than or equal to -9223372036854775808', "
    "'input': '-9223372036854775809', 'ctx': {'ge': -9223372036854775808}}"
)


@pytest.mark.parametrize(("seed", "says"), [(2**63, SEED_TOO_BIG), (-(2**63) - 1, SEED_TOO_SMALL)])
@pytest.mark.parametrize("make", [completion, chat], ids=["completion", "chat"])
def test_a_seed_out_of_range_gets_vllms_message(make: Any, seed: int, says: str) -> None:
    struct = schemas.ChatCompletionRequest if make is chat else schemas.CompletionRequest
    raw = schemas.decode_body(msgspec.json.encode(make(seed=seed)))
    with pytest.raises(errors.BadRequest) as info:
        schemas.validate(raw, struct)
    assert (info.value.status, info.value.message, info.value.param) == (400, says, "body.seed")


def test_a_long_seed_is_cut_in_the_message_as_vllm_cuts_it() -> None:
    message = schemas.seed_out_of_range(10**300)
    assert message is not None
    assert "'input': '" + "1" + "0" * 199 + "...[truncated]'" in message
    assert "'type': 'less_than_equal'" in message


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_seeds_within_int64_are_accepted(seed: int) -> None:
    assert schemas.validate(completion(seed=seed), schemas.CompletionRequest).seed == seed
    assert schemas.seed_out_of_range(seed) is None


def test_content_parts_are_accepted() -> None:
    parts = [{"type": "text", "text": "hello"}]
    body = schemas.validate(
        chat(messages=[{"role": "user", "content": parts}]), schemas.ChatCompletionRequest
    )
    assert body.messages[0].content == parts


def test_top_logprobs_needs_logprobs() -> None:
    with pytest.raises(errors.BadRequest):
        schemas.validate(chat(top_logprobs=2), schemas.ChatCompletionRequest)


def test_include_usage_only_when_streaming() -> None:
    options = {"include_usage": True}
    assert schemas.validate(
        chat(stream=True, stream_options=options), schemas.ChatCompletionRequest
    ).include_usage
    assert not schemas.validate(
        chat(stream_options=options), schemas.ChatCompletionRequest
    ).include_usage


@pytest.mark.parametrize("body", [b"", b"{", b"[]", b"null", b"\xff"])
def test_decode_body_refuses_anything_but_an_object(body: bytes) -> None:
    with pytest.raises(errors.BadRequest):
        schemas.decode_body(body)


@pytest.mark.parametrize(
    "body",
    [b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}", b"[" * 100_000 + b"]" * 100_000],
    ids=["just over the bound", "deep enough to exhaust recursion"],
)
def test_bodies_nested_too_deep_are_a_400(body: bytes) -> None:
    with pytest.raises(errors.BadRequest, match="more than 64 levels deep"):
        schemas.decode_body(body)


def test_nesting_up_to_the_bound_is_fine() -> None:
    inner = b"[" * 63 + b"]" * 63
    assert schemas.decode_body(b'{"a": ' + inner + b"}")["a"]


# Inside a string (msgspec's own check: how it reports it changed in 0.23), and
# outside one, where msgspec sees a character JSON does not allow.
@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"a": "\xff\xfe"}', "invalid start byte"),
        (b'{"a\xc3": 1}', "invalid continuation byte"),
        (b'{"a": "\xed\xa0\x80"}', "invalid continuation byte"),
        (b"\xff", "invalid start byte"),
    ],
)
def test_invalid_utf8_is_a_400_saying_why(body: bytes, reason: str) -> None:
    with pytest.raises(errors.BadRequest, match=f"not valid UTF-8: {reason}"):
        schemas.decode_body(body)


def test_valid_utf8_that_is_not_json_is_a_400_naming_json() -> None:
    with pytest.raises(errors.BadRequest, match="not valid JSON: "):
        schemas.decode_body('{"a": "\u00e9"} x'.encode())
