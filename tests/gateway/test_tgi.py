"""TGI requests -> completions bodies, and worker deltas -> TGI's shapes."""

from __future__ import annotations

import json

import msgspec
import pytest

from gateway import errors
from gateway.dialects import tgi
from shared import protocol


def request(**parameters: object) -> tgi.GenerateRequest:
    return msgspec.convert({"inputs": "Hi", "parameters": parameters}, tgi.GenerateRequest)


def test_no_warper_and_no_do_sample_is_greedy() -> None:
    raw = tgi.to_completion(request(max_new_tokens=7), "m", stream=False)
    assert raw == {"model": "m", "prompt": "Hi", "max_tokens": 7, "stream": False, "temperature": 0}
    assert "seed" not in raw


@pytest.mark.parametrize(
    "parameters", [{"do_sample": True}, {"temperature": 0.5}, {"top_k": 5}, {"top_p": 0.9}]
)
def test_do_sample_or_any_warper_samples_with_a_seed(parameters: dict[str, object]) -> None:
    raw = tgi.to_completion(request(**parameters), "m", stream=False)
    assert raw["temperature"] == parameters.get("temperature", 1.0)
    assert isinstance(raw["seed"], int)


def test_temperature_one_and_top_p_one_alone_stay_greedy() -> None:
    raw = tgi.to_completion(request(temperature=1.0, top_p=1.0), "m", stream=False)
    assert raw["temperature"] == 0


def test_a_given_seed_is_kept() -> None:
    assert tgi.to_completion(request(do_sample=True, seed=3), "m", False)["seed"] == 3


def test_defaults_follow_tgi() -> None:
    raw = tgi.to_completion(msgspec.convert({"inputs": "Hi"}, tgi.GenerateRequest), "m", False)
    assert raw["max_tokens"] == tgi.DEFAULT_MAX_NEW_TOKENS
    assert "logprobs" not in raw


def test_the_other_parameters_map_onto_vllms_names() -> None:
    raw = tgi.to_completion(
        request(
            stop_sequences=["x"],
            truncate=12,
            repetition_penalty=1.2,
            grammar={"type": "regex", "value": "[0-9]+"},
            details=True,
        ),
        "m",
        stream=False,
    )
    assert raw["stop"] == ["x"]
    assert raw["truncate_prompt_tokens"] == 12
    assert raw["repetition_penalty"] == 1.2
    assert raw["structured_outputs"] == {"regex": "[0-9]+"}
    assert raw["logprobs"] == 0


def test_streams_ask_for_token_logprobs_top_n_included() -> None:
    assert tgi.to_completion(request(), "m", stream=True)["logprobs"] == 0
    assert tgi.to_completion(request(top_n_tokens=3), "m", stream=True)["logprobs"] == 3


@pytest.mark.parametrize(
    "parameters",
    [
        {"typical_p": 0.5},
        {"watermark": True},
        {"best_of": 2},
        {"adapter_id": "lora"},
    ],
)
def test_what_vllm_cannot_do_is_refused_by_name(parameters: dict[str, object]) -> None:
    with pytest.raises(errors.BadRequest) as info:
        tgi.check_supported(request(**parameters).parameters)
    assert info.value.param == next(iter(parameters))


def test_decoder_input_details_echo_the_prompt_and_are_refused_when_streaming() -> None:
    asked = request(details=True, decoder_input_details=True)
    assert tgi.to_completion(asked, "m", stream=False)["echo"] is True
    with pytest.raises(errors.BadRequest) as info:
        tgi.to_completion(asked, "m", stream=True)
    assert info.value.param == "decoder_input_details"


@pytest.mark.parametrize(
    ("reason", "stop_reason", "expected"),
    [("length", None, "length"), ("stop", None, "eos_token"), ("stop", 2, "eos_token")],
)
def test_finish_reasons(reason: str, stop_reason: int | None, expected: str) -> None:
    assert tgi.finish_reason(reason, stop_reason) == expected
    assert tgi.finish_reason("stop", "###") == "stop_sequence"


def test_errors_take_tgis_shape_and_status() -> None:
    error = errors.BadRequest("bad")
    assert tgi.error_body(error) == {"error": "bad", "error_type": "validation"}
    assert tgi.error_status(error) == 422
    assert tgi.error_body(errors.Overloaded("busy"))["error_type"] == "overloaded"
    assert tgi.error_status(errors.Overloaded("busy")) == 429


def token(text: str, token_id: int) -> protocol.TokenLogprob:
    return protocol.TokenLogprob(
        token=text,
        logprob=-0.5,
        token_id=token_id,
        top=[protocol.TopLogprob(text, -0.5, token_id, 1)],
    )


def deltas() -> list[protocol.Delta]:
    return [
        protocol.Delta("r", 0, text=" a", num_tokens=1, logprobs=[token(" a", 10)]),
        protocol.Delta(
            "r",
            0,
            text=" b c",
            num_tokens=2,
            logprobs=[token(" b", 11), token(" c", 12)],
            finish_reason="length",
        ),
    ]


def test_stream_events_are_one_per_token_and_the_last_carries_text_and_details() -> None:
    builder = tgi.TgiBuilder("m", request(details=True), seed=None)
    raw = b"".join(builder.chunk(d) for d in deltas())
    events = [json.loads(line.removeprefix(b"data: ")) for line in raw.split(b"\n\n") if line]
    assert [e["index"] for e in events] == [1, 2, 3]
    assert [e["token"]["id"] for e in events] == [10, 11, 12]
    assert events[1]["generated_text"] is None
    assert events[2]["generated_text"] == " a b c"
    assert events[2]["details"] == {"finish_reason": "length", "generated_tokens": 3, "seed": None}
    assert builder.done == b""


def test_body_has_details_only_when_asked_and_a_list_on_the_compat_route() -> None:
    usage = protocol.Usage(prompt_tokens=1, completion_tokens=3)
    plain = tgi.TgiBuilder("m", request(return_full_text=True), seed=None, as_list=True)
    for delta in deltas():
        plain.add(delta)
    assert json.loads(plain.body(usage)) == [{"generated_text": "Hi a b c"}]
    detailed = tgi.TgiBuilder("m", request(details=True), seed=5)
    for delta in deltas():
        detailed.add(delta)
    details = json.loads(detailed.body(usage))["details"]
    assert details["generated_tokens"] == 3
    assert details["seed"] == 5
    assert [t["text"] for t in details["tokens"]] == [" a", " b", " c"]
