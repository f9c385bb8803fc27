"""Deltas become OpenAI's response and chunk shapes."""

from __future__ import annotations

import msgspec

from gateway.dialects import sse
from shared.protocol import Delta, TokenLogprob, TopLogprob, Usage


def decode_event(data: bytes) -> dict:
    assert data.startswith(b"data: ") and data.endswith(b"\n\n")
    return msgspec.json.decode(data[6:-2])


def test_completion_body_joins_deltas_per_choice() -> None:
    builder = sse.Completion("abc", "m", 2, logprobs=None)
    for delta in [
        Delta("abc", 0, "Hel"),
        Delta("abc", 1, "Good"),
        Delta("abc", 0, "lo", 1, None, "stop"),
        Delta("abc", 1, "bye", 1, None, "length"),
    ]:
        builder.add(delta)
    body = msgspec.json.decode(builder.body(Usage(3, 4)))
    assert body["object"] == "text_completion" and body["id"] == "cmpl-abc"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Hello", "stop"),
        (1, "Goodbye", "length"),
    ]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def decode_events(data: bytes) -> list[dict]:
    return [decode_event(part + b"\n\n") for part in data.split(b"\n\n") if part]


def test_chat_streams_open_with_one_role_chunk_per_choice_as_vllm_does() -> None:
    builder = sse.Chat("abc", "m", 2, logprobs=False, top_logprobs=0)
    builder.system_fingerprint = "fp"
    roles_and_first = decode_events(builder.chunk(Delta("abc", 0, "Hi")))
    last = decode_events(builder.chunk(Delta("abc", 0, "!", finish_reason="stop")))
    assert [e["choices"][0]["delta"] for e in roles_and_first] == [
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
    ]
    assert [e["choices"][0]["index"] for e in roles_and_first] == [0, 1, 0]
    assert all(e["object"] == "chat.completion.chunk" for e in roles_and_first)
    assert "stop_reason" not in roles_and_first[2]["choices"][0]  # only on the last chunk
    assert len(last) == 1 and last[0]["choices"][0]["delta"] == {"content": "!"}
    assert last[0]["choices"][0]["finish_reason"] == "stop"
    assert last[0]["system_fingerprint"] == "fp"  # on a choice's last chunk, without usage


def test_usage_chunk_has_no_choices() -> None:
    chunk = decode_event(sse.Chat("abc", "m", 1, False, 0).usage_chunk(Usage(1, 2)))
    assert chunk["choices"] == [] and chunk["usage"]["total_tokens"] == 3


def test_completion_logprobs_offsets_continue_across_chunks() -> None:
    builder = sse.Completion("abc", "m", 1, logprobs=1)
    lp = [TokenLogprob("He", -0.5, [TopLogprob("He", -0.5, 1, 1), TopLogprob("Ha", -1.0, 2, 2)])]
    first = decode_event(builder.chunk(Delta("abc", 0, "He", 1, lp)))
    lp2 = [TokenLogprob("llo", -0.2, [TopLogprob("y", -0.1, 3, 1)])]
    second = decode_event(builder.chunk(Delta("abc", 0, "llo", 1, lp2)))
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]
    # The top-1 alternative, plus the sampled token when it is not among them.
    assert second["choices"][0]["logprobs"]["top_logprobs"] == [{"y": -0.1, "llo": -0.2}]


def test_chat_logprobs_have_bytes_and_top_n() -> None:
    builder = sse.Chat("abc", "m", 1, logprobs=True, top_logprobs=1)
    builder.add(
        Delta(
            "abc",
            0,
            "é",
            1,
            [TokenLogprob("é", -0.1, [TopLogprob("é", -0.1, 4, 1), TopLogprob("e", -3.0, 5, 2)])],
            "stop",
        )
    )
    body = msgspec.json.decode(builder.body(Usage(1, 1)))
    content = body["choices"][0]["logprobs"]["content"]
    assert content == [
        {
            "token": "é",
            "logprob": -0.1,
            "bytes": [195, 169],
            "top_logprobs": [{"token": "é", "logprob": -0.1, "bytes": [195, 169]}],
        }
    ]


def test_an_index_beyond_the_expected_choices_does_not_crash() -> None:
    builder = sse.Completion("abc", "m", 1, logprobs=None)
    builder.add(Delta("abc", 3, "x"))
    assert len(msgspec.json.decode(builder.body(Usage(0, 1)))["choices"]) == 4


# What str.splitlines (and httpx's aiter_lines) ends a line at and JSON does not escape.
LINE_ENDS_IN_TEXT = "one\x85two\u2028three\u2029four"


def test_a_chunk_whose_text_holds_line_ends_json_keeps_is_one_data_line() -> None:
    completion = sse.Completion("abc", "m", 1, logprobs=None).chunk(
        Delta("abc", 0, LINE_ENDS_IN_TEXT)
    )
    chat = sse.Chat("abc", "m", 1, logprobs=False, top_logprobs=0).chunk(
        Delta("abc", 0, LINE_ENDS_IN_TEXT)
    )
    texts = []
    for stream in (completion, chat):
        data_lines = [line for line in stream.decode().splitlines() if line]
        assert all(line.startswith("data: {") for line in data_lines), data_lines
        texts.append(msgspec.json.decode(data_lines[-1][6:])["choices"][0])
    assert texts[0]["text"] == LINE_ENDS_IN_TEXT
    assert texts[1]["delta"]["content"] == LINE_ENDS_IN_TEXT
