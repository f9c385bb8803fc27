"""Worker deltas -> OpenAI response JSON, whole or as server-sent events.

One :class:`Completion` or :class:`Chat` per request keeps what the shapes
need across deltas (text offsets for completion logprobs, whether a
choice's first chunk, which carries the assistant role, went out yet) and
turns deltas into either one response body or a stream of chunks, as
OpenAI's API (and vLLM's server) format them.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from shared import protocol

encode = msgspec.json.encode

DONE = b"data: [DONE]\n\n"


def event(payload: Any) -> bytes:
    return b"data: " + encode(payload) + b"\n\n"


def usage_json(usage: protocol.Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class _Choice:
    __slots__ = ("echo", "finish_reason", "logprobs", "offset", "started", "stop_reason", "text")

    def __init__(self) -> None:
        self.echo = ""
        self.text: list[str] = []
        self.logprobs: list[protocol.TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # Characters of text already streamed (completion logprobs' text_offset).
        self.offset = 0
        self.started = False

    def add(self, delta: protocol.Delta) -> None:
        if delta.echo is not None:
            self.echo = delta.echo
            self.text.append(delta.echo)
        self.text.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


class _Response:
    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, request_id: str, model: str, num_choices: int) -> None:
        self.id = self.id_prefix + request_id
        self.model = model
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(num_choices)]

    def reset(self) -> None:
        """Forget all output (the request is being retried from scratch)."""
        self.choices = [_Choice() for _ in self.choices]

    def _choice(self, index: int) -> _Choice:
        while index >= len(self.choices):  # defensive: never trust a peer's index
            self.choices.append(_Choice())
        return self.choices[index]

    def add(self, delta: protocol.Delta) -> None:
        self._choice(delta.index).add(delta)

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def usage_chunk(self, usage: protocol.Usage) -> bytes:
        payload = self._envelope(self.chunk_object_name)
        payload["choices"] = []
        payload["usage"] = usage_json(usage)
        return event(payload)

    def body(self, usage: protocol.Usage) -> bytes:
        payload = self._envelope(self.object_name)
        payload["choices"] = [self._final_choice(i, c) for i, c in enumerate(self.choices)]
        payload["usage"] = usage_json(usage)
        return encode(payload)

    def _final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, delta: protocol.Delta) -> bytes:
        raise NotImplementedError


class Completion(_Response):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, request_id: str, model: str, num_choices: int, logprobs: int | None) -> None:
        super().__init__(request_id, model, num_choices)
        self.top_n = logprobs

    def _logprobs(self, tokens: list[protocol.TokenLogprob], offset: int) -> dict[str, Any]:
        text_offset = []
        for token in tokens:
            text_offset.append(offset)
            offset += len(token.token)
        return {
            "tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [self._top(t) for t in tokens],
            "text_offset": text_offset,
        }

    def _top(self, token: protocol.TokenLogprob) -> dict[str, float]:
        # The N most likely tokens, plus the sampled one even when it is not
        # among them, as vLLM reports it.
        top = dict(token.top[: self.top_n or 0])
        top.setdefault(token.token, token.logprob)
        return top

    def _final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        return {
            "index": index,
            "text": "".join(choice.text),
            "logprobs": (
                self._logprobs(choice.logprobs, len(choice.echo))
                if self.top_n is not None
                else None
            ),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def chunk(self, delta: protocol.Delta) -> bytes:
        choice = self._choice(delta.index)
        text = delta.text if delta.echo is None else delta.echo + delta.text
        if delta.echo is not None:
            choice.offset += len(delta.echo)
        logprobs = None
        if self.top_n is not None:
            logprobs = self._logprobs(delta.logprobs or [], choice.offset)
        choice.offset += len(delta.text)
        payload = self._envelope(self.chunk_object_name)
        payload["choices"] = [
            {
                "index": delta.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }
        ]
        return event(payload)


class Chat(_Response):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(
        self, request_id: str, model: str, num_choices: int, logprobs: bool, top_logprobs: int
    ) -> None:
        super().__init__(request_id, model, num_choices)
        self.want_logprobs = logprobs
        self.top_n = top_logprobs

    def _logprobs(self, tokens: list[protocol.TokenLogprob]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return {
            "content": [
                {
                    "token": t.token,
                    "logprob": t.logprob,
                    "bytes": list(t.token.encode()),
                    "top_logprobs": [
                        {"token": tok, "logprob": lp, "bytes": list(tok.encode())}
                        for tok, lp in t.top[: self.top_n]
                    ],
                }
                for t in tokens
            ]
        }

    def _final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": "".join(choice.text)},
            "logprobs": self._logprobs(choice.logprobs),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def chunk(self, delta: protocol.Delta) -> bytes:
        choice = self._choice(delta.index)
        message: dict[str, Any] = {"content": delta.text}
        if not choice.started:
            # OpenAI's first chunk of each choice names the role.
            choice.started = True
            message = {"role": "assistant", "content": delta.text}
        payload = self._envelope(self.chunk_object_name)
        payload["choices"] = [
            {
                "index": delta.index,
                "delta": message,
                "logprobs": self._logprobs(delta.logprobs or []),
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }
        ]
        return event(payload)
