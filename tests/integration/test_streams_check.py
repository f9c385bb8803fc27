"""The token-by-token stream check itself, on chunks vLLM was seen to send.

The check must pass the chunks vLLM legitimately sends around characters split
across tokens (both seen with sampled text on the embedded model) and still
catch a chunk whose text is not its tokens'.
"""

from __future__ import annotations

import json
from typing import Any

from tests.integration.streams import Stream


def chunk(text: str, tokens: list[str]) -> str:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": {"tokens": tokens}}
    return "data: " + json.dumps({"choices": [choice]})


def read(*chunks: str) -> Stream:
    """A stream of ``chunks`` whose usage counts the tokens they show."""
    stream = Stream()
    for line in chunks:
        stream.read_line(line)
    usage = {"choices": [], "usage": {"completion_tokens": len(stream.tokens)}}
    stream.read_line("data: " + json.dumps(usage))
    stream.read_line("data: [DONE]")
    return stream


def test_bytes_released_as_a_replacement_character_are_not_a_mismatch() -> None:
    # A lone first byte of a character, then a token that does not complete it:
    # vLLM releases the held-back byte as "\ufffd" with the next token's text.
    stream = read(chunk("", ["\ufffd"]), chunk("\ufffd)(", [")("]))
    assert stream.whole(2), stream.mismatched


def test_a_merged_chunk_with_a_split_character_is_not_a_mismatch() -> None:
    # Seen: four tokens in one chunk (the worker's front end fell behind), one
    # of them a lone byte named "", released as "\ufffd" with the next.
    stream = read(chunk("فی \ufffdت", ["ف", "ی", "", "ت"]))
    assert stream.whole(4), stream.mismatched


def test_a_chunk_whose_text_is_not_its_tokens_is_caught() -> None:
    stream = read(chunk(" once", [" once"]), chunk(" upon", [" a"]))
    assert not stream.whole(2)
    assert stream.mismatched == [json.loads(chunk(" upon", [" a"])[6:])["choices"][0]]
