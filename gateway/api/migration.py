"""A stream whose worker fails mid-answer goes on on another worker.

Before its first token a failed request is retried from scratch
(``gateway.api.attempts``). After it, a stream that :func:`movable` allows
keeps what it generated (:class:`Seam`: every delta's token ids) and, when
its worker is lost, drains or drops it, goes to another worker of its pool
with those ids (``protocol.Generate.continuation``): that worker renders
the prompt as the first did, appends them and generates the rest, and its
usage counts both parts. The client sees one stream: one id, no error
event, every token once. It moves at most ``--max-migrations`` times. A
whole (non-streamed) request moves the same way (``Attempts.run``), its
answer so far kept in its builder.

What does not move (its stream ends with an error event, as before):
several choices, prompt logprobs and echo (the next worker's prompt is
another), structured output and tools (their state is the first engine's),
and vLLM's own routes. Stop strings move: the next worker sends the text
the first engine held back and checks them across the seam
(``worker.seam_stops``). Logprobs move: the next worker scores the tokens
it generates, those before were scored and sent already.
Tokens whose text the engine held back (the start of a multi-byte
character) are generated again by the next worker rather than carried;
with logprobs, whose entries for them went out already, such a stream
cannot move.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

from gateway import errors, metrics
from gateway.api.failures import Failure, reason_of, retryable
from gateway.dispatch.handle import RequestHandle
from gateway.tracing import RequestSpan
from shared import protocol

log = logging.getLogger(__name__)

# Fields whose answer depends on state the first engine kept (a grammar, a
# parser) or on the prompt, which the next worker's is not (its logprobs,
# its echo).
_STAYS = frozenset(
    (
        "prompt_logprobs",
        "echo",
        "tools",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    )
)

# The next worker's first delta, from the continued tokens and the worker
# to avoid ("": none): ``Attempts.start`` with them.
Resume = Callable[[protocol.Continuation, str], Awaitable[tuple[RequestHandle, protocol.Delta]]]


def movable(kind: protocol.RequestKind, params: dict[str, Any]) -> bool:
    """Whether a stream of this request can go on on another worker (but for its
    worker's parser of tools or reasoning, known once it answers)."""
    if kind not in ("chat", "completion"):
        return False
    if (params.get("n") or 1) != 1 or (params.get("best_of") or 1) != 1:
        return False
    response_format = params.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in (None, "text"):
        response_format = None
    if response_format or any(params[name] for name in _STAYS.intersection(params)):
        return False
    prompt = params.get("prompt")
    return not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))


class Seam:
    """What a stream that may move has generated so far, and its moves."""

    __slots__ = (
        "carried",
        "chars",
        "finished",
        "held",
        "ids",
        "limit",
        "moves",
        "prompt_tokens",
        "resume",
        "scored",
    )

    def __init__(self, limit: int, resume: Resume) -> None:
        # --max-migrations: moves at most.
        self.limit = limit
        self.resume = resume
        self.moves = 0
        # Token ids of the answer so far, 4 bytes each (a list would keep an
        # object per id: a megabyte for a 32k-token answer); None once a
        # worker sent a delta without them (then it cannot move).
        self.ids: array[int] | None = array("i")
        # The last of them whose text the engine held back (the start of a
        # multi-byte character): the next worker generates them again.
        self.held = 0
        self.finished = False
        # The prompt's tokens, as the first worker counted them.
        self.prompt_tokens = 0
        # Tokens carried to the current worker: the answer's before it.
        self.carried = 0
        # Characters of the answer's text sent to the client (the next
        # worker sends what an engine held back for a stop string).
        self.chars = 0
        # Whether its tokens' logprobs went out with them.
        self.scored = False

    def add(self, delta: protocol.Delta) -> None:
        """One delta that went out to the client."""
        if delta.prompt_tokens and not self.prompt_tokens:
            self.prompt_tokens = delta.prompt_tokens
        if delta.finish_reason is not None:
            self.finished = True
        self.chars += len(delta.text)
        if delta.logprobs:
            self.scored = True
        if not delta.num_tokens or self.ids is None:
            return
        ids = delta.token_ids
        if ids is None or len(ids) != delta.num_tokens:
            self.ids = None
            return
        self.ids.extend(ids)
        self.held = self.held + len(ids) if not delta.text else 0

    def computed(self, handle: RequestHandle) -> protocol.Usage | None:
        """What the stream is billed for if it ends before its usage: the
        current worker's count, the tokens carried to it included."""
        computed = handle.computed()
        if computed is None or not self.carried:
            return computed
        return protocol.Usage(computed.prompt_tokens, computed.completion_tokens + self.carried)

    async def move(
        self,
        failure: Failure,
        handle: RequestHandle,
        span: RequestSpan,
        log_extra: dict[str, str],
    ) -> tuple[RequestHandle, protocol.Delta] | None:
        """The stream's next worker and its first delta, or its usage when the
        answer was whole already; None when it cannot move (the caller ends
        it with the failure). Raises the ``errors.GatewayError`` of a move
        that found no worker to take it."""
        if self.ids is None or self.moves >= self.limit or not retryable(failure):
            return None
        if self.held and self.scored:
            # The held tokens' logprobs went out: generated again, they would twice.
            return None
        reason = reason_of(failure)
        worker = handle.answered_by.address
        if self.finished:
            # Its last token came; only the usage did not.
            usage = protocol.Usage(self.prompt_tokens, len(self.ids))
            log.info("stream whole but for its usage (%s): ended here", reason, extra=log_extra)
            return handle, protocol.Delta(request_id=handle.request_id, index=0, usage=usage)
        self.moves += 1
        continuation = self.ids[: len(self.ids) - self.held].tolist()
        metrics.MIGRATIONS.labels(reason).inc()
        metrics.MIGRATED_TOKENS.inc(len(continuation))
        log.info(
            "moving the answer on from %s (%s) after %d tokens",
            worker,
            reason,
            len(continuation),
            extra=log_extra,
        )
        if span.on:
            span.event("migrated", reason=reason, worker=worker, tokens=len(continuation))
        handle.close()
        # A worker that dropped it because this gateway went quiet did so for
        # no fault of its own: it may take it again (as ``Retries.after``).
        avoid = "" if reason == protocol.GATEWAY_SILENT else worker
        moved, first = await self.resume(protocol.Continuation(continuation, self.chars), avoid)
        del self.ids[len(continuation) :]
        self.held = 0
        self.carried = len(continuation)
        return moved, first


def moved_error(exc: errors.GatewayError) -> errors.GatewayError:
    """The error event of a stream that found no worker to move to."""
    return errors.UpstreamFailed(f"The stream was cut and could not move on: {exc.message}")
