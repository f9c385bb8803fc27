"""One API request from admission to its last byte, whatever API it came in by.

:class:`Call` admits a request, hands it to a worker (``pool``, which applies
the routing policy), and turns the worker's deltas into a response through
a builder (``sse`` for OpenAI's shapes, ``tgi`` for TGI's).

A streaming response starts only once the worker has produced its first
delta, so errors the engine finds up front (a prompt longer than the
context, a bad parameter) still get a proper status code, and a request
whose worker is lost before any output is retried on another worker
(``--max-retries``) whether it streams or not. Once output has gone out, a
lost worker ends the stream with an error event.

A client that goes away aborts its request on the worker: until the
response starts (queued, waiting for its worker or its first token) the
request watches for the ASGI ``http.disconnect`` message
(``gateway.api.http.DisconnectWatch``); a stream that has started sees it
as cancellation or closing of its body (``EventStream``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway import cascade, errors, metrics, routes, schemas, sse, tracing
from gateway.api.cached import CACHE_HEADER, STREAM_HEADERS, CacheStep, replay
from gateway.api.http import DisconnectWatch, EventStream, deadline, header
from gateway.api.request_ids import request_id_of
from gateway.handle import RequestHandle, WorkerLost
from gateway.models import Target
from gateway.pool import Pool
from gateway.workers import WorkerState
from shared import protocol

log = logging.getLogger(__name__)

JSON = "application/json"

SESSION_HEADER = b"x-session-id"
WORKER_HEADER = "x-llmgate-worker"
# The served model and the pool that answered (the body's ``model`` stays the
# requested name, as OpenAI's does), and the auto rule that chose them.
MODEL_HEADER = "x-llmgate-model"
POOL_HEADER = "x-llmgate-pool"
ROUTE_HEADER = "x-llmgate-route"
CASCADE_HEADER = "x-llmgate-cascade"
# The routes whose answers are cached (OpenAI's; TGI's are not).
CACHED_ROUTES = frozenset({routes.COMPLETIONS.path, routes.CHAT.path})


def pool_of(request: Request) -> Pool:
    pool: Pool = request.app.state.pool
    return pool


@dataclass
class Call:
    """One API request from admission to its last byte, retries included."""

    request: Request
    kind: protocol.RequestKind
    route: str
    raw: dict[str, Any]
    body: schemas._Sampling | schemas.VllmRequest
    builder: sse.ResponseBuilder
    # What the worker gets, when not ``raw``: a "vllm" request's method, path
    # and body (``gateway.api.vllm_routes``).
    wire: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.wire is None:
            self.wire = self.raw
        self.pool = pool_of(self.request)
        self.request_id = request_id_of(self.request.scope)
        # Log lines about this request name it (shared.logs).
        self.log_extra = {"request_id": self.request_id}
        self.started = time.monotonic()
        self.deadline = deadline(self.request, self.pool.settings.request_timeout)
        self.tried: set[WorkerState] = set()
        # Why the last worker tried failed: the 503 says it if none is left.
        self.last_failure: str | None = None
        self.failures = 0  # attempts that failed and were retried (--max-retries)
        self.builder.include_usage = self.body.include_usage
        # The response is named by the client's id (a retry's wire id has a suffix).
        self.builder.id = self.builder.id_prefix + self.request_id
        self._done = False  # counted in the metrics (_finish)
        # Which pools may run it (aliases, auto; gateway.models). Resolved in
        # serve(): an auto rule's metrics count only requests that got there.
        self.target: Target | None = None
        self.cascade_outcome = ""  # accepted or escalated (gateway.cascade)
        # The response cache's part (gateway.api.cached), and the worker's
        # output as it came while the answer may be stored.
        cache = self.request.app.state.cache
        # vLLM's own answers ("vllm") are not: the cache stores our deltas.
        cacheable = self.route in CACHED_ROUTES and self.kind != "vllm"
        self.cached = CacheStep(cache) if cache is not None and cacheable else None
        self.recorded: list[protocol.Delta] | None = None
        self.span = tracing.request_span(
            self.request.scope["headers"],
            self.request_id,
            self.body.model,
            self.route,
            self.body.stream,
        )

    async def serve(self, key_of: Callable[[int], str]) -> Response:
        settings = self.pool.settings
        key = None
        if self.pool.policy.uses_key:
            session = header(self.request, SESSION_HEADER) or self.body.user
            key = session if session else key_of(settings.prefix_chars)
        # Until the response starts, a client that leaves cancels this task:
        # waiting in the queue, for its worker, or for the first token.
        watch = DisconnectWatch(self.request)
        try:
            self.target = self.pool.names.resolve(
                self.body.model, self.raw, self.request.scope["headers"]
            )
            if self.cached is not None:
                hit = await self._look_up(self.cached)
                if hit is not None:
                    return hit
            if self.body.stream:
                return await self._start_stream(key)
            return await self._complete(key)
        except asyncio.CancelledError:
            if not watch.disconnected:
                self._finish(500)  # shutting down: counted, its span ended
                raise
            watch.task.uncancel()
            log.info("client disconnected before the response started", extra=self.log_extra)
            self._finish(499)  # nginx's "client closed request"
            return Response(status_code=499)
        except errors.GatewayError as exc:
            self._finish(exc.status)
            raise
        except BaseException:
            self._finish(500)  # shutting down, or a bug: counted, its span ended
            raise
        finally:
            watch.stop()

    # -- attempts ------------------------------------------------------------

    async def _submit(self, key: str | None, raw: dict[str, Any]) -> RequestHandle:
        span = self.span
        assert self.target is not None
        try:
            handle = await self.pool.submit(
                self.request_id,
                self.kind,
                self.target,
                raw,
                self.deadline,
                key,
                exclude=self.tried,
                trace=span.headers(),
                on_queued=(lambda: span.event("queued")) if span.on else None,
                # A batch job's line (gateway.batch.runner): after interactive requests.
                low_priority=self.request.scope.get("llmgate.priority") == "batch",
            )
        except errors.NoWorker as exc:
            if self.tried and self.last_failure:
                raise errors.NoWorker(
                    f"{exc.message} The worker that had it: {self.last_failure}."
                ) from exc
            raise
        if span.on:
            span.event("routed", worker=handle.worker.address)
        self.builder.system_fingerprint = handle.worker.system_fingerprint
        self.builder.chat_parser = handle.worker.chat_parser
        return handle

    def _retry_or_raise(self, handle: RequestHandle, item: WorkerLost | protocol.Failed) -> None:
        """Record a failed attempt; raise if it cannot be retried."""
        retryable = isinstance(item, WorkerLost) or item.status == 503
        if not retryable:
            assert isinstance(item, protocol.Failed)
            log.info(
                "the worker failed the request: %d %s",
                item.status,
                item.message,
                extra=self.log_extra,
            )
            raise errors.from_status(item.status, item.message, item.param)
        # The retries metric's label: what the worker said of its 503 (known
        # causes only: a label value must not come from the wire unchecked).
        if isinstance(item, WorkerLost):
            reason = "worker_lost"
        elif item.cause in (protocol.WORKER_DRAINING, protocol.GATEWAY_SILENT):
            reason = item.cause
        else:
            reason = "worker_refused"
        message = item.reason if isinstance(item, WorkerLost) else item.message
        self.last_failure = message
        self.failures += 1
        if self.failures > self.pool.settings.max_retries:
            raise errors.UpstreamFailed(
                f"The request failed {self.failures} times; last: {message}."
            )
        if reason == protocol.GATEWAY_SILENT:
            # The worker dropped it because this gateway went quiet (paused or
            # starved), not for a fault of its own: it may run it again.
            where = "on any worker"
        else:
            self.tried.add(handle.worker)
            where = "on another worker"
        metrics.RETRIES.labels(reason).inc()
        log.info(
            "retrying %s: %s on %s",
            where,
            message,
            handle.worker.address,
            extra=self.log_extra,
        )
        if self.span.on:
            self.span.event("retry", reason=message, worker=handle.worker.address)

    # -- non-streaming -------------------------------------------------------

    async def _complete(self, key: str | None) -> Response:
        target = self.target
        # The cascade judges our own builder's logprobs: not vLLM's answers.
        if target is not None and target.escalate_to is not None and self.kind != "vllm":
            return await self._cascade(key, target.escalate_to)
        assert self.wire is not None
        handle, usage = await self._attempts(key, self.wire)
        return await self._respond(handle, usage)

    async def _attempts(
        self, key: str | None, raw: dict[str, Any]
    ) -> tuple[RequestHandle, protocol.Usage]:
        """Run the request to its end on a worker (retrying on another one if
        its worker is lost); its output is in the builder."""
        while True:
            handle = await self._submit(key, raw)
            try:
                outcome = await self._collect(handle)
            finally:
                handle.close()
            if isinstance(outcome, protocol.Usage):
                return handle, outcome
            self._retry_or_raise(handle, outcome)
            self._forget_output()

    async def _respond(self, handle: RequestHandle, usage: protocol.Usage) -> Response:
        headers = self._headers(handle)
        await self._store(handle, usage, headers)
        self._finish(200, usage)
        return Response(self.builder.body(usage), media_type=JSON, headers=headers)

    def _forget_output(self) -> None:
        """The request runs again from scratch (a retry, an escalation)."""
        self.builder.reset()
        if self.recorded is not None:
            self.recorded.clear()

    async def _cascade(self, key: str | None, escalate_to: Target) -> Response:
        """The default model's answer if it is good enough, else the escalation
        target's (``gateway.cascade``)."""
        assert self.target is not None
        handle, usage = await self._attempts(key, cascade.with_logprobs(self.kind, self.raw))
        reason = cascade.shortfall(self.builder, self.raw, self.target.min_mean_logprob)
        if reason is None:
            self.cascade_outcome = "accepted"
            metrics.CASCADE.labels("accepted").inc()
            return await self._respond(handle, usage)
        log.debug(
            "cascade: escalating from %s to %s (%s)",
            self.target.model,
            escalate_to.model,
            reason,
            extra=self.log_extra,
        )
        self.cascade_outcome = "escalated"
        metrics.CASCADE.labels("escalated").inc()
        self._forget_output()
        self.tried = set()
        self.last_failure = None
        self.failures = 0
        self.target = Target(escalate_to.model, escalate_to.tiers, rule=self.target.rule)
        handle, usage = await self._attempts(key, self.raw)
        return await self._respond(handle, usage)

    async def _collect(
        self, handle: RequestHandle
    ) -> protocol.Usage | protocol.Failed | WorkerLost:
        first = True
        while True:
            item = await handle.next()
            if not isinstance(item, protocol.Delta):
                return item
            if first:
                self.span.event("first_token")
                first = False
            if item.usage is not None:
                return item.usage
            self.builder.add(item)
            if self.recorded is not None:
                self.recorded.append(item)

    # -- streaming -----------------------------------------------------------

    async def _start_stream(self, key: str | None) -> Response:
        assert self.wire is not None
        while True:
            handle = await self._submit(key, self.wire)
            first: protocol.Delta | protocol.Failed | WorkerLost | None = None
            try:
                first = await handle.next()
                if isinstance(first, protocol.Delta):
                    handle.streaming = True
                    break
                self._retry_or_raise(handle, first)
            finally:
                if not isinstance(first, protocol.Delta):
                    handle.close()
        return EventStream(
            self._stream(handle, first),
            release=lambda: self._release_stream(handle),
            headers={**STREAM_HEADERS, **self._headers(handle)},
        )

    def _headers(self, handle: RequestHandle) -> dict[str, str]:
        """Who answered: the worker, its served model and pool, the auto rule."""
        tier = handle.tier
        headers = {WORKER_HEADER: handle.worker.key, MODEL_HEADER: tier.model}
        pool = tier.pool or handle.worker.pool  # a LoRA adapter's: its worker's
        if pool:
            headers[POOL_HEADER] = pool
        if self.target is not None and self.target.rule:
            headers[ROUTE_HEADER] = self.target.rule
        if self.cascade_outcome:
            headers[CASCADE_HEADER] = self.cascade_outcome
        if self.cached is not None:
            headers[CACHE_HEADER] = self.cached.result
        return headers

    def _release_stream(self, handle: RequestHandle) -> None:
        """The response is over and its generator never ran to its finally
        (the client left before the first write): abort and count it here."""
        if not self._done:
            handle.close()
            self._finish(499)

    async def _stream(self, handle: RequestHandle, first: protocol.Delta) -> AsyncIterator[bytes]:
        # Runs inside the response: a client that goes away cancels it here (or
        # closes it), and the finally clause aborts the request on the worker.
        include_usage = self.body.include_usage
        recorded = self.recorded
        item: protocol.Delta | protocol.Failed | WorkerLost = first
        last_chunk = 0.0
        status = 200
        usage = None
        model = self.body.model
        itl = metrics.child(metrics.ITL, model)
        try:
            while True:
                if isinstance(item, protocol.Failed):
                    status = item.status
                    # A stream under way ends early: worth a line, whatever the status.
                    log.warning(
                        "stream ended by its worker: %d %s",
                        item.status,
                        item.message,
                        extra=self.log_extra,
                    )
                    yield self.builder.error_event(
                        errors.from_status(item.status, item.message, item.param)
                    )
                    break
                if isinstance(item, WorkerLost):
                    status = 502
                    log.warning("stream cut: %s", item.reason, extra=self.log_extra)
                    yield self.builder.error_event(
                        errors.UpstreamFailed(f"The stream was cut: {item.reason}.")
                    )
                    break
                if item.usage is not None:
                    usage = item.usage
                    if include_usage:
                        yield self.builder.usage_chunk(item.usage)
                    # Stored before the stream ends, so a client that reads
                    # to [DONE] can count on the next request hitting.
                    await self._store(handle, usage, self._headers(handle))
                    break
                now = time.monotonic()
                if last_chunk:
                    itl.observe(now - last_chunk)
                else:
                    metrics.child(metrics.TTFT, model, self.route).observe(now - self.started)
                    self.span.event("first_token")
                last_chunk = now
                # Deltas that queued up meanwhile go out in the same write: one
                # transport write per batch, not per token, under load.
                chunks = [self.builder.chunk(item)]
                if recorded is not None:
                    recorded.append(item)
                waiting = handle.next_nowait()
                while isinstance(waiting, protocol.Delta) and waiting.usage is None:
                    chunks.append(self.builder.chunk(waiting))
                    if recorded is not None:
                        recorded.append(waiting)
                    waiting = handle.next_nowait()
                yield chunks[0] if len(chunks) == 1 else b"".join(chunks)
                try:
                    item = await handle.next() if waiting is None else waiting
                except errors.GatewayError as exc:
                    status = exc.status
                    log.warning("stream ended: %s", exc, extra=self.log_extra)
                    yield self.builder.error_event(exc)
                    break
            if self.builder.done:
                yield self.builder.done
        except (asyncio.CancelledError, GeneratorExit):
            status = 499
            raise
        except BaseException:
            status = 500
            raise
        finally:
            handle.close()
            self._finish(status, usage)

    # -- the response cache ------------------------------------------------------

    async def _look_up(self, cached: CacheStep) -> Response | None:
        """The stored answer, replayed; None to compute it (recording it if it may be kept)."""
        assert self.target is not None
        workers = self.pool.healthy_workers()
        entry = await cached.look_up(
            self.kind,
            self.target.model,
            self.raw,
            header(self.request, b"cache-control"),
            workers,
        )
        if entry is None:
            self.recorded = cached.recorded
            return None
        # Streamed in the shape its model's workers stream it (sse.Chat.chunk).
        self.builder.chat_parser = any(
            w.chat_parser for w in workers if entry.served_model in w.models
        )
        self._finish(200)
        return replay(self.builder, entry, self.body.stream, self.body.include_usage)

    async def _store(
        self, handle: RequestHandle, usage: protocol.Usage, headers: dict[str, str]
    ) -> None:
        if self.cached is None or self.recorded is None:
            return
        await self.cached.store(
            usage,
            len(self.builder.choices),
            handle.tier.model,
            handle.worker.system_fingerprint,
            {k: v for k, v in headers.items() if k not in (WORKER_HEADER, CACHE_HEADER)},
        )

    # -- accounting ------------------------------------------------------------

    def _finish(self, status: int, usage: protocol.Usage | None = None) -> None:
        """Count the request once, by its final status."""
        if self._done:
            return
        self._done = True
        self.span.end(status)
        route = self.route
        model = self.body.model
        if model not in self.pool.known_models:
            model = metrics.UNKNOWN_MODEL
        child = metrics.child
        child(metrics.REQUESTS, model, route, str(status)).inc()
        child(metrics.E2E_LATENCY, model, route).observe(time.monotonic() - self.started)
        if usage is not None:
            child(metrics.PROMPT_TOKENS, model).inc(usage.prompt_tokens)
            child(metrics.GENERATION_TOKENS, model).inc(usage.completion_tokens)
