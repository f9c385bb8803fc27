"""The usage of a forwarded chat or completion stream, whatever its client asked for.

vLLM's server counts a stream's tokens in it only under
``stream_options.include_usage``; without it a forwarded stream would end
with no count of what the engine did, and its API key would pay nothing.
So every forwarded stream asks vLLM for usage on every chunk
(``continuous_usage_stats``): :class:`StreamUsage` reads the counts as they
grow (what a stream cut half-way has cost) and takes out of the bytes what
the client did not ask for, the usage on each chunk and the final usage
chunk. vLLM moves ``system_fingerprint`` to that final chunk when it sends
one; for a client that asked for none it goes back on each finished
choice's chunk, where vLLM puts it then.
"""

from __future__ import annotations

import json
from typing import Any

from shared import protocol


class StreamUsage:
    """One forwarded stream's body (:attr:`body`, to send to vLLM) and its chunks' counts."""

    def __init__(self, body: dict[str, Any], system_fingerprint: str) -> None:
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        self.client_usage = bool(options.get("include_usage"))
        self.client_continuous = self.client_usage and bool(options.get("continuous_usage_stats"))
        self.body = {
            **body,
            "stream_options": {**options, "include_usage": True, "continuous_usage_stats": True},
        }
        self.system_fingerprint = system_fingerprint
        # Tokens told so far: the prompt's once, each choice's as it grows.
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._choices: dict[int, int] = {}
        self.usage: protocol.Usage | None = None  # the final usage chunk's
        self._partial = b""

    def feed(self, chunk: bytes) -> tuple[bytes, int, int]:
        """``chunk`` as the client gets it, and the prompt and completion tokens
        it adds to what the engine has computed for the request."""
        data = self._partial + chunk
        complete, _, self._partial = data.rpartition(b"\n\n")
        if not complete:
            return b"", 0, 0
        prompt_before, completion_before = self.prompt_tokens, self.completion_tokens
        out = [self._event(event) for event in complete.split(b"\n\n")]
        text = b"".join(event + b"\n\n" for event in out if event)
        return (
            text,
            self.prompt_tokens - prompt_before,
            self.completion_tokens - completion_before,
        )

    def rest(self) -> bytes:
        """What came after the last whole event (nothing, from vLLM)."""
        rest, self._partial = self._partial, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        """One event as the client gets it (empty: not at all)."""
        if not event.startswith(b"data: {"):
            return event
        try:
            value = json.loads(event[6:])
        except ValueError:
            return event
        usage = value.get("usage") if isinstance(value, dict) else None
        if not isinstance(usage, dict):
            return event
        choices = value.get("choices")
        if not choices:  # the final usage chunk: the request's whole count
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                self.usage = protocol.Usage(prompt, completion)
                self.prompt_tokens = max(self.prompt_tokens, prompt)
                self.completion_tokens = max(self.completion_tokens, completion)
            return event if self.client_usage else b""
        self._count(choices, usage)
        if self.client_continuous:
            return event
        del value["usage"]
        if not self.client_usage and self.system_fingerprint:
            if any(isinstance(c, dict) and c.get("finish_reason") for c in choices):
                value["system_fingerprint"] = self.system_fingerprint
        return b"data: " + json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()

    def _count(self, choices: list[Any], usage: dict[str, Any]) -> None:
        """A chunk's continuous usage: its prompt's tokens, and its choice's so far
        (vLLM counts each choice on its own chunks)."""
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        index = choices[0].get("index", 0) if isinstance(choices[0], dict) else 0
        if isinstance(prompt, int) and not self.prompt_tokens:
            self.prompt_tokens = prompt
        if isinstance(completion, int) and isinstance(index, int):
            self._choices[index] = completion
            self.completion_tokens = max(self.completion_tokens, sum(self._choices.values()))
