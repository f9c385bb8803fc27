"""Worker deltas -> OpenAI response JSON, whole or as server-sent events.

One :class:`Completion` or :class:`Chat` per request keeps what the shapes
need across deltas (text offsets for completion logprobs, whether the
assistant-role chunks went out yet) and turns deltas into either one
response body or a stream of chunks, exactly as vLLM's OpenAI server (0.32)
formats them, down to the fields it always sends as null: the parity test
(``tests/integration/test_parity.py``) compares the two field by field.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.dialects.jsonresp import encode
from gateway.errors import GatewayError
from shared import protocol

DONE = b"data: [DONE]\n\n"

# Characters JSON leaves raw (msgspec, like vLLM's pydantic, writes them as
# UTF-8) that Python's ``str.splitlines`` takes as line ends, and with it
# httpx's ``aiter_lines``, a common way to read a stream: a sampled token
# can be one, and the event's data line then reached such a client as two
# halves of JSON. Escaped, they are the same string to any JSON reader.
_LINE_ENDS_JSON_KEEPS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def event(payload: Any) -> bytes:
    """One server-sent event carrying ``payload``: a data line no reader splits."""
    data = encode(payload)
    for raw, escaped in _LINE_ENDS_JSON_KEEPS:
        data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


def usage_json(usage: protocol.Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class _Choice:
    __slots__ = (
        "echo",
        "echo_logprobs",
        "finish_reason",
        "logprobs",
        "offset",
        "stop_reason",
        "text",
    )

    def __init__(self) -> None:
        self.echo = ""
        self.text: list[str] = []
        self.logprobs: list[protocol.TokenLogprob] = []
        self.echo_logprobs: list[protocol.TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # Characters of text already streamed (completion logprobs' text_offset).
        self.offset = 0

    def add(self, delta: protocol.Delta) -> None:
        if delta.echo is not None:
            self.echo = delta.echo
            self.text.append(delta.echo)
        if delta.echo_logprobs:
            self.echo_logprobs.extend(delta.echo_logprobs)
        self.text.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


class ResponseBuilder:
    object_name = ""
    chunk_object_name = ""
    id_prefix = ""
    # What ends a stream, after the last chunk or an error event.
    done = DONE
    # Top-level fields vLLM's whole responses always carry as null.
    null_fields: tuple[str, ...] = ()

    def __init__(self, request_id: str, model: str, num_choices: int) -> None:
        self.id = self.id_prefix + request_id
        self.model = model
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(num_choices)]
        # The serving worker's (set per attempt) and whether usage ends the stream.
        self.system_fingerprint: str | None = None
        self.include_usage = False
        # The worker runs vLLM with a tool or reasoning parser (Chat.chunk).
        self.chat_parser = False

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

    def error_event(self, error: GatewayError) -> bytes:
        """The event that tells a streaming client its request failed."""
        return event(error.body())

    def usage_chunk(self, usage: protocol.Usage) -> bytes:
        payload = self._envelope(self.chunk_object_name)
        payload["choices"] = []
        payload["usage"] = usage_json(usage)
        payload["system_fingerprint"] = self.system_fingerprint
        return event(payload)

    def body(self, usage: protocol.Usage) -> bytes:
        payload = self._envelope(self.object_name)
        payload["choices"] = [self._final_choice(i, c) for i, c in enumerate(self.choices)]
        payload["service_tier"] = None
        payload["system_fingerprint"] = self.system_fingerprint
        payload["usage"] = {
            **usage_json(usage),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        for name in self.null_fields:
            payload[name] = None
        return encode(payload)

    def _chunk(self, choice: dict[str, Any], finished: bool) -> bytes:
        payload = self._envelope(self.chunk_object_name)
        payload["choices"] = [choice]
        if finished and not self.include_usage:
            # vLLM names the engine on a choice's last chunk, or on the usage chunk.
            payload["system_fingerprint"] = self.system_fingerprint
        return event(payload)

    def _final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, delta: protocol.Delta) -> bytes:
        raise NotImplementedError


class Completion(ResponseBuilder):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl-"
    null_fields = ("kv_transfer_params", "ec_transfer_params", "metrics")

    def __init__(self, request_id: str, model: str, num_choices: int, logprobs: int | None) -> None:
        super().__init__(request_id, model, num_choices)
        self.top_n = logprobs

    def _logprobs(self, tokens: list[protocol.TokenLogprob], offset: int) -> dict[str, Any]:
        # Offsets advance by each token's text, as vLLM counts them (text held
        # back for a stop string does not shift them).
        text_offset = []
        for token in tokens:
            text_offset.append(offset)
            offset += len(token.token)
        return {
            "tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob if t.scored else None for t in tokens],
            "top_logprobs": [self._top(t) if t.scored else None for t in tokens],
            "text_offset": text_offset,
        }

    def _top(self, token: protocol.TokenLogprob) -> dict[str, float]:
        # The N most likely tokens, plus the sampled one even when it is not
        # among them, as vLLM reports it.
        top = {t.token: t.logprob for t in token.top[: self.top_n or 0]}
        top.setdefault(token.token, token.logprob)
        return top

    @staticmethod
    def _prompt_logprobs(tokens: list[protocol.TokenLogprob]) -> list[Any] | None:
        """vLLM's raw ``prompt_logprobs``: per prompt token, id -> logprob, rank, text."""
        if not tokens:
            return None
        return [
            {
                str(top.token_id): {
                    "logprob": top.logprob,
                    "rank": top.rank,
                    "decoded_token": top.token,
                }
                for top in t.top
            }
            if t.scored
            else None
            for t in tokens
        ]

    def _final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        return {
            "index": index,
            "text": "".join(choice.text),
            "logprobs": (
                self._logprobs(choice.echo_logprobs + choice.logprobs, 0)
                if self.top_n is not None
                else None
            ),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "token_ids": None,
            "prompt_logprobs": self._prompt_logprobs(choice.echo_logprobs),
            "prompt_token_ids": None,
            "routed_experts": None,
        }

    def chunk(self, delta: protocol.Delta) -> bytes:
        choice = self._choice(delta.index)
        text = delta.text if delta.echo is None else delta.echo + delta.text
        logprobs = None
        if self.top_n is not None:
            tokens = (delta.echo_logprobs or []) + (delta.logprobs or [])
            logprobs = self._logprobs(tokens, choice.offset)
            choice.offset += sum(len(t.token) for t in tokens)
        return self._chunk(
            {
                "index": delta.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
                "prompt_token_ids": delta.prompt_token_ids,
                "token_ids": None,
            },
            finished=delta.finish_reason is not None,
        )


class Chat(ResponseBuilder):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    null_fields = (
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    )

    def __init__(
        self, request_id: str, model: str, num_choices: int, logprobs: bool, top_logprobs: int
    ) -> None:
        super().__init__(request_id, model, num_choices)
        self.want_logprobs = logprobs
        self.top_n = top_logprobs
        self.roles_sent = False

    def reset(self) -> None:
        super().reset()
        self.roles_sent = False

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
                        {
                            "token": top.token,
                            "logprob": top.logprob,
                            "bytes": list(top.token.encode()),
                        }
                        for top in t.top[: self.top_n]
                    ],
                }
                for t in tokens
            ]
        }

    def _final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        return {
            "index": index,
            "message": {
                "role": "assistant",
                "content": "".join(choice.text),
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": self._logprobs(choice.logprobs),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "token_ids": None,
            "routed_experts": None,
        }

    def _role_chunks(self) -> bytes:
        """vLLM's first chunks: one per choice, naming the role, with empty content."""
        chunks = []
        for index in range(len(self.choices)):
            payload = self._envelope(self.chunk_object_name)
            payload["choices"] = [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
            payload["prompt_token_ids"] = None
            payload["prompt_text"] = None
            chunks.append(event(payload))
        return b"".join(chunks)

    def chunk(self, delta: protocol.Delta) -> bytes:
        self._choice(delta.index)
        roles = b""
        if not self.roles_sent:
            self.roles_sent = True
            roles = self._role_chunks()
        finished = delta.finish_reason is not None
        content: dict[str, Any] = {"content": delta.text}
        if self.chat_parser and not delta.text:
            # Under a parser, vLLM sends no chunk for empty text (unless it
            # carries logprobs or ends the choice), and an empty delta then.
            if not finished and not self.want_logprobs:
                return roles
            content = {}
        choice: dict[str, Any] = {
            "index": delta.index,
            "delta": content,
            "logprobs": self._logprobs(delta.logprobs or []),
            "finish_reason": delta.finish_reason,
        }
        if finished:
            choice["stop_reason"] = delta.stop_reason
        choice["token_ids"] = None
        return roles + self._chunk(choice, finished)


class Passthrough(ResponseBuilder):
    """The body vLLM's own server answered (``worker.vllm_app``), forwarded as is.

    Its JSON, or its SSE events with their ``[DONE]`` or Responses API event
    names, is ``vllm serve``'s byte for byte: nothing is added but the error
    event of a stream the gateway had to cut.
    """

    done = b""

    def __init__(self, model: str) -> None:
        super().__init__("", model, 0)
        self.parts: list[bytes] = []

    def reset(self) -> None:
        self.parts = []

    def add(self, delta: protocol.Delta) -> None:
        if delta.raw:
            self.parts.append(delta.raw)

    def chunk(self, delta: protocol.Delta) -> bytes:
        return delta.raw or b""

    def usage_chunk(self, usage: protocol.Usage) -> bytes:
        return b""  # vLLM's stream carries its own, when asked

    def body(self, usage: protocol.Usage) -> bytes:
        return b"".join(self.parts)
