"""worker.passthrough: the usage read from the bytes of vLLM's own server (no engine)."""

from __future__ import annotations

from shared import protocol
from worker.passthrough import body_usage, stream_usage


def test_a_whole_body_gives_its_usage_in_either_api_s_names() -> None:
    chat = b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}'
    responses = b'{"output": [], "usage": {"input_tokens": 5, "output_tokens": 6}}'
    assert body_usage(chat) == protocol.Usage(3, 4)
    assert body_usage(responses) == protocol.Usage(5, 6)
    assert body_usage(b'{"choices": []}') is None
    assert body_usage(b"not json") is None


def test_a_stream_chunk_gives_the_last_usage_it_carries() -> None:
    chunk = (
        b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert stream_usage(chunk) == protocol.Usage(1, 2)
    assert stream_usage(b'data: {"choices": []}\n\n') is None
    # A Responses API event nests it in its response.
    event = (
        b"event: response.completed\n"
        b'data: {"response": {"usage": {"input_tokens": 2, "output_tokens": 3}}}\n\n'
    )
    assert stream_usage(event) == protocol.Usage(2, 3)
