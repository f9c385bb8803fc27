"""What the worker's server asks of an engine: :class:`ModelEngine`.

The worker's ZeroMQ loop (``worker.server``) and its heartbeats
(``worker.liveness``) talk to this interface only. ``worker.engine.Engine``
(vLLM's ``AsyncLLM``) implements it, and so does the benchmark and
fault-injection double ``loadtest.fake_engine.FakeEngine``, without
inheriting anything of vLLM's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from shared import protocol
from worker.prepare import PreparedPrompt


class ModelEngine(Protocol):
    # Model names requests may ask for (LoRA adapters included).
    served_model_names: list[str]
    # Requests it runs at once (vLLM's ``max_num_seqs``): the gateway's slots.
    max_num_seqs: int
    max_model_len: int
    # What its answers say as ``system_fingerprint``.
    system_fingerprint: str
    # Its chats stream as under a vLLM tool or reasoning parser; under a
    # reasoning parser only vLLM's own server builds them.
    chat_parser: bool
    reasoning_parser: bool
    # The port its engine publishes KV cache events on (0: none), the port it
    # replays missed batches on (0: none), and its block size.
    kv_events_port: int
    kv_replay_port: int
    kv_block_size: int

    @property
    def loras(self) -> Mapping[str, Any]:
        """Its LoRA adapters by name (``served_model_names`` holds them too)."""
        ...

    async def start(self) -> None:
        """Ready what requests need beyond the model (vLLM's server app)."""
        ...

    def describe_tokenizer(self) -> tuple[str, str, dict[str, str]] | None:
        """Its tokenizer's JSON, the chat template it applies and the special tokens
        that template names; None if it has no fast tokenizer."""
        ...

    def engine_priority(self, priority: int) -> int:
        """The priority a request the gateway sent with ``priority`` runs at."""
        ...

    async def prepare(
        self,
        kind: protocol.RequestKind,
        params: dict[str, Any],
        continuation: protocol.Continuation | None = None,
    ) -> list[PreparedPrompt]:
        """Validate, render and tokenize one request: one entry per prompt;
        raises ``worker.errors.RequestError`` for what it refuses. With a
        ``continuation`` (``Generate.continuation``), its one prompt goes on
        from those tokens (``worker.continuation``)."""
        ...

    def run(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        trace: dict[str, str] | None = None,
        model: str = "",
        priority: int = 0,
    ) -> AsyncIterator[list[protocol.Delta]]:
        """A prepared request's deltas as they come; the last item carries its usage."""
        ...

    def passthrough(
        self, request_id: str, params: dict[str, Any], model: str = "", priority: int = 0
    ) -> AsyncIterator[list[protocol.Delta]]:
        """A request for a route of vLLM's own server: its body's bytes as raw
        deltas, then its usage."""
        ...

    def load(self) -> tuple[int, int, float]:
        """(running, waiting, KV-cache usage ratio) now, for the heartbeats."""
        ...

    def shutdown(self) -> None: ...
