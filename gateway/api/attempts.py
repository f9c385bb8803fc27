"""A request's attempts on workers: submission, the retry policy, collection.

:class:`Attempts` sends a request to a worker through the pool and reads
what comes back. An attempt that fails before anything reached the client
is retried on another worker, up to ``--max-retries`` times, when the
worker was lost or refused it with 503 (draining, or it dropped the request
because this gateway went silent: then any worker may take it again, that
one included). :class:`Retries` is what the failed attempts so far allow.
Any other failure is the client's answer at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway import errors, metrics
from gateway.api.failures import Failure, reason_of, retryable
from gateway.api.migration import Seam
from gateway.dialects import sse
from gateway.dispatch.handle import Answerer, RequestHandle, WorkerLost
from gateway.dispatch.models import Target
from gateway.dispatch.pool import Pool
from gateway.dispatch.work import WorkOrder
from gateway.tracing import RequestSpan
from shared import protocol

log = logging.getLogger(__name__)


class Retries(msgspec.Struct, frozen=True):
    """What one run's failed attempts allow: a value, replaced after each failure."""

    # --max-retries: failed attempts retried at most.
    limit: int
    failures: int = 0
    # Addresses of the workers not to try again.
    tried: frozenset[str] = frozenset()
    # Why the last attempt failed: a 503 says it if no worker is left.
    last_failure: str = ""

    def after(self, failure: Failure, worker: str) -> Retries:
        """The state once a retryable ``failure`` ended an attempt on ``worker``;
        raises ``errors.UpstreamFailed`` past the limit."""
        message = failure.reason if isinstance(failure, WorkerLost) else failure.message
        failures = self.failures + 1
        if failures > self.limit:
            raise errors.UpstreamFailed(f"The request failed {failures} times; last: {message}.")
        # A worker that dropped the request because this gateway went quiet
        # (paused or starved) did so for no fault of its own: it may run it again.
        silent = reason_of(failure) == protocol.GATEWAY_SILENT
        tried = self.tried if silent else self.tried | {worker}
        return Retries(self.limit, failures, tried, message)

    def no_worker(self, refused: errors.NoWorker) -> errors.NoWorker:
        """The 503 when no worker is left: naming why the last one failed, if one did."""
        if self.tried and self.last_failure:
            return errors.NoWorker(
                f"{refused.message} The worker that had it: {self.last_failure}."
            )
        return refused


@dataclass(slots=True)
class Attempts:
    """One request's attempts: each sent through the pool, its output into ``builder``
    (and into ``recorded``, while the response cache may keep the answer)."""

    pool: Pool
    request_id: str
    kind: protocol.RequestKind
    deadline: float
    # The routing key (prefix policy), or None.
    key: str | None
    builder: sse.ResponseBuilder
    span: RequestSpan
    max_retries: int
    recorded: list[protocol.Delta] | None = None
    # Its priority band (``protocol.BANDS``): its key's, or lower.
    band: int = 0
    # The API key's id: admission shares slots fairly between keys.
    tenant: str | None = None
    # Whether ``key`` is the client's hint (every policy honours it).
    hinted: bool = False
    # The latest attempt's handle: what the engine computed for it.
    handle: RequestHandle | None = None
    # A request that moved on mid-answer: what it carried to that attempt.
    moved: Seam | None = None

    @property
    def log_extra(self) -> dict[str, str]:
        return {"request_id": self.request_id}

    async def run(
        self,
        target: Target,
        raw: dict[str, Any],
        seam: Callable[[], Seam] | None = None,
    ) -> tuple[Answerer, protocol.Usage]:
        """Run the request on ``target`` to its end, retrying while it may; who
        answered, and the usage. Its output is in the builder.

        With a ``seam`` (``gateway.api.migration``: the request may move) an
        attempt that fails after its first tokens goes on on another worker
        from them, keeping what the builder has; one that fails before, or
        cannot move, runs again from scratch. (The deltas are only kept as
        they come, and the seam made of them on a failure: most requests
        never fail.)"""
        retries = Retries(self.max_retries)
        while True:
            handle = await self._submit(target, raw, retries, movable=seam is not None)
            # Its worker parses tools or reasoning: that state cannot move.
            kept: list[protocol.Delta] | None = (
                [] if seam is not None and not handle.answered_by.chat_parser else None
            )
            moving: Seam | None = None
            first: protocol.Delta | None = None
            while True:
                try:
                    outcome = await self._collect(handle, kept, first)
                finally:
                    handle.close()
                if isinstance(outcome, protocol.Usage):
                    return handle.answered_by, outcome
                if seam is None or not kept:
                    break
                if moving is None:
                    moving = seam()
                for delta in kept:
                    moving.add(delta)
                kept.clear()
                moved = await moving.move(outcome, handle, self.span, self.log_extra)
                if moved is None:
                    break
                handle, first = moved
                self.moved = moving
            retries = self._retry(retries, handle, outcome)
            self.moved = None
            self.forget_output()

    async def start(
        self,
        target: Target,
        raw: dict[str, Any],
        continuation: protocol.Continuation | None = None,
        avoid: frozenset[str] = frozenset(),
        movable: bool = False,
    ) -> tuple[RequestHandle, protocol.Delta]:
        """Run the request on ``target`` until its first delta, retrying while it
        may; its handle, from then on a stream's (it is no longer retried), and
        that delta. The caller closes the handle.

        A stream that moves on from a failed worker (``gateway.api.migration``)
        passes the tokens it generated (``continuation``) and that worker
        (``avoid``); a stream that can move (``movable``) does not wait for a
        silent worker, as one that cannot does (``Delivery.streaming``), and a
        draining worker hands it over (``Pool.worker_draining``)."""
        retries = Retries(self.max_retries, tried=avoid)
        while True:
            handle = await self._submit(target, raw, retries, continuation, movable)
            first: protocol.Delta | Failure | None = None
            try:
                first = await handle.next()
                if isinstance(first, protocol.Delta):
                    if not movable:
                        handle.mark_streaming()
                    return handle, first
                retries = self._retry(retries, handle, first)
            finally:
                if not isinstance(first, protocol.Delta):
                    handle.close()

    def computed(self) -> protocol.Usage | None:
        """What the engine computed for the latest attempt, so far (the one the
        client was being answered from: a retried attempt is not billed), the
        tokens a move carried to it included."""
        handle = self.handle
        if handle is None:
            return None
        return self.moved.computed(handle) if self.moved is not None else handle.computed()

    def forget_output(self) -> None:
        """The request runs again from scratch (a retry, an escalation)."""
        self.builder.reset()
        if self.recorded is not None:
            self.recorded.clear()

    async def _submit(
        self,
        target: Target,
        raw: dict[str, Any],
        retries: Retries,
        continuation: protocol.Continuation | None = None,
        movable: bool = False,
    ) -> RequestHandle:
        span = self.span
        try:
            order = WorkOrder(
                self.request_id,
                self.kind,
                target,
                raw,
                self.deadline,
                self.key,
                span.headers(),
                self.band,
                self.tenant,
                self.hinted,
                continuation,
                movable,
            )
            queued = (lambda: span.event("queued")) if span.on else None
            handle = await self.pool.submit(order, retries.tried, queued)
        except errors.NoWorker as exc:
            refused = retries.no_worker(exc)
            if refused is exc:
                raise
            raise refused from exc
        self.handle = handle
        answered_by = handle.answered_by
        if span.on:
            span.event("routed", worker=answered_by.address)
        self.builder.system_fingerprint = answered_by.system_fingerprint
        self.builder.chat_parser = answered_by.chat_parser
        return handle

    def _retry(self, retries: Retries, handle: RequestHandle, failure: Failure) -> Retries:
        """The retry state after a failed attempt; raises if it cannot be retried."""
        if not retryable(failure):
            assert isinstance(failure, protocol.Failed)
            log.info(
                "the worker failed the request: %d %s",
                failure.status,
                failure.message,
                extra=self.log_extra,
            )
            raise errors.from_status(failure.status, failure.message, failure.param)
        worker = handle.answered_by.address
        retries = retries.after(failure, worker)
        reason = reason_of(failure)
        where = "on any worker" if reason == protocol.GATEWAY_SILENT else "on another worker"
        metrics.RETRIES.labels(reason).inc()
        log.info("retrying %s: %s on %s", where, retries.last_failure, worker, extra=self.log_extra)
        if self.span.on:
            self.span.event("retry", reason=retries.last_failure, worker=worker)
        return retries

    async def _collect(
        self,
        handle: RequestHandle,
        kept: list[protocol.Delta] | None = None,
        first: protocol.Delta | None = None,
    ) -> protocol.Usage | Failure:
        """Read the attempt to its end, its output into the builder (and its
        deltas into ``kept``): the usage, or the failure. ``first``: its first
        delta, read already (a moved request's)."""
        builder, recorded = self.builder, self.recorded
        starting = first is None
        while True:  # handle.next(), not ``async for``: a coroutine less per item
            item: protocol.Delta | Failure
            if first is not None:
                item, first = first, None
            else:
                item = await handle.next()
            if not isinstance(item, protocol.Delta):
                return item
            if starting:
                self.span.event("first_token")
                starting = False
            if kept is not None:
                kept.append(item)
            if item.usage is not None:
                return item.usage
            builder.add(item)
            if recorded is not None:
                recorded.append(item)
