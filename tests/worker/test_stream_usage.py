"""worker/stream_usage.py: a forwarded stream reports its usage to the gateway, and to its
client only what it asked for."""

from __future__ import annotations

import json
from typing import Any

from shared import protocol
from worker.stream_usage import StreamUsage


def event(value: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


def chunk(index: int, text: str, completion: int, finish: str | None = None) -> bytes:
    """A chat chunk as vLLM sends it under continuous usage stats."""
    return event(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": 7,
                "total_tokens": 7 + completion,
                "completion_tokens": completion,
            },
        }
    )


FINAL = event(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 7, "total_tokens": 10, "completion_tokens": 3},
        "system_fingerprint": "fp",
    }
)


def events(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in data.split(b"\n\n") if line.startswith(b"data: {")]


def test_a_stream_that_asked_for_no_usage_gets_none_and_its_tokens_are_counted() -> None:
    tap = StreamUsage({"stream": True, "messages": []}, "fp")
    assert tap.body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    seen = []
    counts = []
    for part in (
        chunk(0, "a", 1),
        chunk(0, "b", 2),
        chunk(0, "c", 3, "stop"),
        FINAL,
        b"data: [DONE]\n\n",
    ):
        text, prompt, completion = tap.feed(part)
        seen.append(text)
        counts.append((prompt, completion))
    assert counts == [(7, 1), (0, 1), (0, 1), (0, 0), (0, 0)]
    out = events(b"".join(seen))
    assert all("usage" not in value for value in out)
    assert [value["choices"][0]["delta"]["content"] for value in out] == ["a", "b", "c"]
    # vLLM puts the fingerprint on a finished choice's chunk when it sends no usage.
    assert [value.get("system_fingerprint") for value in out] == [None, None, "fp"]
    assert seen[-1] == b"data: [DONE]\n\n"
    assert tap.usage == protocol.Usage(7, 3)


def test_a_stream_that_asked_for_usage_gets_the_final_chunk_but_not_each_chunks() -> None:
    tap = StreamUsage({"stream": True, "stream_options": {"include_usage": True}}, "fp")
    text, _, _ = tap.feed(chunk(0, "a", 1) + chunk(0, "b", 2, "length") + FINAL)
    out = events(text)
    assert [("usage" in value) for value in out] == [False, False, True]
    assert "system_fingerprint" not in out[1]  # it stays on the usage chunk, as vLLM sends it
    assert out[2]["usage"]["completion_tokens"] == 3


def test_a_stream_that_asked_for_continuous_usage_gets_the_bytes_as_they_came() -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    tap = StreamUsage({"stream": True, "stream_options": options}, "fp")
    data = chunk(0, "a", 1) + FINAL
    assert tap.feed(data)[0] == data


def test_choices_are_counted_each_on_its_own_chunks_and_a_cut_stream_knows_its_tokens() -> None:
    tap = StreamUsage({"stream": True, "n": 2}, "")
    totals = 0
    for part in (chunk(0, "a", 1), chunk(1, "x", 1), chunk(0, "b", 2), chunk(1, "y", 2)):
        totals += tap.feed(part)[2]
    assert totals == 4 == tap.completion_tokens
    assert tap.usage is None  # cut before the final chunk: the counts so far are all there is


def test_an_event_split_across_chunks_goes_out_whole_once_complete() -> None:
    tap = StreamUsage({"stream": True}, "")
    whole = chunk(0, "a", 1)
    first = tap.feed(whole[:20])
    assert first == (b"", 0, 0)
    text, prompt, completion = tap.feed(whole[20:])
    assert events(text)[0]["choices"][0]["delta"]["content"] == "a"
    assert (prompt, completion) == (7, 1)
