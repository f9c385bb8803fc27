"""Reading a completions stream token by token, to check that none is lost.

A chunk of a stream is not a token: when a worker's front end falls behind
its engine (a busy core, a pause), vLLM merges the engine's outputs for a
request into one, and that output becomes one chunk carrying several tokens,
as under ``vllm serve``. So the invariant is checked on tokens, which the
stream shows when it is asked for ``logprobs``: a stream either ends with an
error event, or it carries exactly the tokens the engine generated for it
(as many as its usage counts), in order, each once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

# What a streaming request adds so its stream can be checked token by token.
TOKENS_SHOWN = {"logprobs": 1, "stream_options": {"include_usage": True}}


@dataclass
class Stream:
    status: int = 0
    worker: str | None = None
    chunks: int = 0
    text: str = ""
    # Every token as the chunks' logprobs name it, in order.
    tokens: list[str] = field(default_factory=list)
    # Chunks whose text is not their tokens' text (special tokens aside).
    mismatched: list[dict[str, Any]] = field(default_factory=list)
    usage_tokens: int | None = None
    error: str | None = None
    done: bool = False
    # More than 1: the worker merged engine outputs (it fell behind its engine).
    most_tokens_in_a_chunk: int = 0

    def read_line(self, line: str) -> None:
        if line == "data: [DONE]":
            self.done = True
            return
        if not line.startswith("data: "):
            return
        payload = json.loads(line[6:])
        if "error" in payload:
            self.error = payload["error"]["message"]
            return
        if payload.get("usage") and not payload.get("choices"):
            self.usage_tokens = payload["usage"]["completion_tokens"]
            return
        choice = payload["choices"][0]
        tokens = choice["logprobs"]["tokens"] if choice.get("logprobs") else []
        self.chunks += 1
        self.text += choice["text"]
        self.tokens += tokens
        self.most_tokens_in_a_chunk = max(self.most_tokens_in_a_chunk, len(tokens))
        joined = "".join(t for t in tokens if not _special(t))
        # A token that is part of a character (one byte of "é") is named "\ufffd"
        # or "" on its own, and vLLM holds the text back until the character is
        # whole; when the next token does not complete it, vLLM releases the
        # bytes as "\ufffd" in front of that token's text. Such a chunk's text
        # is not its tokens' names joined (sampled text has them); every other
        # chunk's must be.
        split_character = "\ufffd" in joined + choice["text"] or "" in tokens
        if not split_character and choice["text"] != joined:
            self.mismatched.append(choice)

    def whole(self, expected_tokens: int) -> bool:
        """Ended normally with exactly ``expected_tokens`` tokens, each in its chunk's text."""
        return (
            self.error is None
            and self.done
            and len(self.tokens) == expected_tokens == self.usage_tokens
            and not self.mismatched
        )


def _special(token: str) -> bool:
    # Special tokens are named in logprobs but skipped in the text, as vLLM does.
    return token.startswith("<|") and token.endswith("|>")


async def read_stream(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    on_first_chunk: Callable[[Stream], None] | None = None,
) -> Stream:
    """POST a streaming completions request (tokens shown) and read it to its end.

    ``on_first_chunk`` is called once the stream's first chunk has arrived.
    """
    stream = Stream()
    try:
        async with client.stream(
            "POST", "/v1/completions", json={**body, **TOKENS_SHOWN, "stream": True}
        ) as response:
            stream.status = response.status_code
            stream.worker = response.headers.get("x-llmgate-worker")
            if response.status_code != 200:
                stream.error = (await response.aread()).decode(errors="replace")
                return stream
            async for line in response.aiter_lines():
                stream.read_line(line)
                if on_first_chunk is not None and stream.chunks == 1:
                    on_first_chunk(stream)
                    on_first_chunk = None
    except httpx.HTTPError as exc:
        stream.error = repr(exc)
    return stream


@dataclass
class PlainStream:
    """A stream read as a client reads it (such a stream may move to another
    worker mid-answer: gateway/api/migration.py)."""

    worker: str | None = None
    # Every chunk's id: one, for a stream that reads as one.
    ids: set[str] = field(default_factory=set)
    text: str = ""
    # The tokens its logprobs entries name, when it asked for them.
    scored: list[str] = field(default_factory=list)
    usage: dict[str, int] | None = None
    error: str | None = None
    done: bool = False


def scored_tokens(logprobs: dict[str, Any] | None) -> list[str]:
    """The tokens a chunk's logprobs name (a chat's ``content``, a completion's ``tokens``)."""
    if not logprobs:
        return []
    if "content" in logprobs:
        return [entry["token"] for entry in logprobs["content"] or []]
    return list(logprobs.get("tokens") or [])


async def read_plain(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    on_first_chunk: Callable[[], None] | None = None,
    chars: int = 0,
) -> PlainStream:
    """POST a streaming completions or chat request (usage included) and read it
    to its end: its text (a chat's content), usage, chunk ids and error event.
    ``on_first_chunk`` is called at its first chunk, or with ``chars`` once its
    text has that many characters."""
    stream = PlainStream()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", path, json=body) as response:
        stream.worker = response.headers.get("x-llmgate-worker")
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                stream.done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stream.error = chunk["error"]["message"]
                    continue
                stream.ids.add(chunk["id"])
                stream.usage = chunk.get("usage") or stream.usage
                for choice in chunk["choices"]:
                    delta = choice.get("delta")
                    stream.text += (delta.get("content") or "") if delta else choice["text"]
                    stream.scored += scored_tokens(choice.get("logprobs"))
                if on_first_chunk is not None and len(stream.text) >= chars:
                    on_first_chunk()
                    on_first_chunk = None
    return stream


def events_with_ids(
    url: str, body: dict[str, Any], headers: dict[str, str], until_pieces: int = 0
) -> list[tuple[str, str]]:
    """POST a resumable stream (or its resumption) and read it: each event's
    SSE id (``""`` for none) and data, to the end, or until ``until_pieces``
    chunks with text came (then the client drops)."""
    read: list[tuple[str, str]] = []
    pieces = 0
    with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as stream:
        assert stream.status_code == 200, stream.read()
        event_id = ""
        for line in stream.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                read.append((event_id, line[6:]))
                event_id = ""
                if line != "data: [DONE]" and piece_of(json.loads(line[6:])):
                    pieces += 1
                    if pieces == until_pieces:
                        break
    return read


def piece_of(chunk: dict[str, Any]) -> str:
    """A chunk's text (a chat's content, a completion's text)."""
    return "".join(
        (c.get("delta") or {}).get("content") or "" if "delta" in c else c.get("text") or ""
        for c in chunk.get("choices") or []
    )
