"""One API request from admission to its last byte, whatever API it came in by.

:class:`Call` resolves the request's model to its pools (``pool.resolve``), takes
its key's limits (``gateway.tenants``), answers from the response cache when it
may (``gateway.api.cached``), else runs it on a worker (``gateway.api.attempts``:
admission, routing, retries) and turns the deltas into a response through a
builder (``sse``, ``tgi``): whole, after ``gateway.dispatch.cascade`` kept or
escalated a cascaded answer, or streamed (``gateway.api.streaming``). A stream
starts only at its first delta, so an error found up front keeps its status code
and a lost worker is retried until output has gone out. Who answered goes in the
headers (``gateway.api.headers``); the request is counted once, by its final
status (``gateway.api.accounting``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway import errors, tracing
from gateway.api import migration
from gateway.api.accounting import Accounting
from gateway.api.attempts import Attempts
from gateway.api.bands import asked_band
from gateway.api.cached import cache_step
from gateway.api.headers import STREAM_HEADERS, answer_headers
from gateway.api.http import DisconnectWatch, EventStream, deadline, header
from gateway.api.request_ids import request_id_of
from gateway.api.services import services_of
from gateway.api.streaming import relay
from gateway.context import BAND_HEADER, context_of
from gateway.dialects import schemas, sse
from gateway.dialects.jsonresp import JSONAnswer
from gateway.dispatch import cascade
from gateway.dispatch.handle import Answerer, RequestHandle
from gateway.dispatch.models import Target
from gateway.tenants import limits
from shared import protocol

log = logging.getLogger(__name__)

SESSION_HEADER = b"x-session-id"


def _cache_key(raw: dict[str, Any]) -> str | None:
    """OpenAI's ``prompt_cache_key``: requests sharing one share a prefix."""
    value = raw.get("prompt_cache_key")
    return value if isinstance(value, str) and value else None


# The band an answer ran in, when not the first.
BAND_NAME = BAND_HEADER.decode()


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
        self.services = services = services_of(self.request)
        self.pool = services.pool
        self.settings = services.settings
        self.request_id = request_id_of(self.request.scope)
        # Who sends it, and its hold on its key's limits (gateway.context).
        self.context = context_of(self.request.scope)
        # Log lines about this request name it (shared.logs).
        self.log_extra = {"request_id": self.request_id}
        self.deadline = deadline(self.request, self.settings.http.request_timeout)
        self.builder.include_usage = self.body.include_usage
        # The response is named by the client's id (a retry's wire id has a suffix).
        self.builder.id = self.builder.id_prefix + self.request_id
        # Which pools may run it (aliases, auto; gateway.dispatch.models). Resolved in
        # serve(): an auto rule's metrics count only requests that got there.
        self.target: Target | None = None
        self.cascade_outcome = ""  # accepted or escalated (gateway.dispatch.cascade)
        self.cached = cache_step(services.cache, self.route, self.kind)
        span = tracing.request_span(
            self.request.scope["headers"],
            self.request_id,
            self.body.model,
            self.route,
            self.body.stream,
        )
        self.account = Accounting(
            span,
            self.body.model,
            self.route,
            self.pool.known_models,
            self.context,
            services.ledger,
        )
        # The request's attempts on workers, once it has any.
        self.attempts: Attempts | None = None
        # Its priority band (protocol.BANDS): its key's, until its ask is checked.
        self.band = self.context.band

    async def serve(self, key_of: Callable[[int], str]) -> Response:
        # A client's hint keeps its requests together under every policy;
        # without one, the prefix and kv policies key a request by its user or
        # its conversation's start.
        key = header(self.request, SESSION_HEADER) or _cache_key(self.raw)
        hinted = bool(key)
        if not key and self.pool.uses_key:
            key = self.body.user or key_of(self.settings.routing.prefix_chars)
        # Until the response starts, a client that leaves cancels this task:
        # waiting in the queue, for its worker, or for the first token.
        watch = DisconnectWatch(self.request)
        try:
            entry = self.context.key
            if entry is not None and not entry.allows(self.body.model):
                raise errors.Forbidden(
                    f"The API key {entry.name!r} may not use the model `{self.body.model}`.",
                    "model",
                )
            # A lower band than its key's, if it asks for one (gateway.api.bands).
            asked = asked_band(self.context.band_header, self.raw)
            if asked:
                self.context.asked_band = asked
                self.band = self.context.band
            self.target = self.pool.resolve(
                self.body.model, self.raw, self.request.scope["headers"]
            )
            # The key's limits: 429 over them (gateway.tenants).
            choices = len(self.builder.choices)
            await limits.admit(
                self.services.limits, self.context, self.pool, self.target, self.raw, choices
            )
            if self.cached is not None:
                hit = await self.cached.look_up(
                    self.pool,
                    self.target.model,
                    self.raw,
                    header(self.request, b"cache-control"),
                    self.builder,
                    self.body.stream,
                )
                if hit is not None:
                    self.account.finish(200, self.cached.usage, cached=True)
                    return hit
            attempts = self.attempts = self._attempts(key, hinted)
            if self.body.stream:
                return await self._start_stream(attempts, self.target)
            return await self._complete(attempts, self.target)
        except asyncio.CancelledError:
            if not watch.disconnected:
                self.account.finish(500, self._computed())  # shutting down
                raise
            watch.task.uncancel()
            log.info("client disconnected before the response started", extra=self.log_extra)
            self.account.finish(499, self._computed())  # nginx's "client closed request"
            return Response(status_code=499)
        except errors.GatewayError as exc:
            self.account.finish(exc.status, self._computed())
            raise
        except BaseException:
            self.account.finish(500, self._computed())  # shutting down, or a bug
            raise
        finally:
            watch.stop()

    def _computed(self) -> protocol.Usage | None:
        """What the engine computed for the request's last attempt, so far."""
        return self.attempts.computed() if self.attempts is not None else None

    def _attempts(self, key: str | None, hinted: bool = False) -> Attempts:
        return Attempts(
            pool=self.pool,
            request_id=self.request_id,
            kind=self.kind,
            deadline=self.deadline,
            key=key,
            hinted=hinted,
            builder=self.builder,
            span=self.account.span,
            max_retries=self.settings.routing.max_retries,
            # The worker's output as it comes, while the answer may be cached.
            recorded=self.cached.recorded if self.cached is not None else None,
            band=self.band,
            tenant=self.context.owner,
        )

    async def _complete(self, attempts: Attempts, target: Target) -> Response:
        if cascade.applies(target, self.kind):
            (answered_by, usage), self.cascade_outcome = await cascade.run(
                target,
                self.kind,
                self.raw,
                self.builder,
                attempts,
                self.log_extra,
            )
        else:
            assert self.wire is not None
            limit = self.settings.routing.max_migrations
            seam = (
                (lambda: migration.Seam(limit, self._resume(attempts, target)))
                if self._movable()
                else None
            )
            answered_by, usage = await attempts.run(target, self.wire, seam)
        headers = self._headers(answered_by)
        if self.cached is not None:
            await self.cached.store(usage, len(self.builder.choices), answered_by, headers)
        self.account.finish(200, usage)
        return JSONAnswer(self.builder.body(usage), headers)

    async def _start_stream(self, attempts: Attempts, target: Target) -> Response:
        assert self.wire is not None
        # Nothing goes out before the first delta: an error the engine finds up
        # front (a prompt longer than the context, a bad parameter) still gets
        # its status code, and a worker lost before any output is retried.
        movable = self._movable()
        handle, first = await attempts.start(target, self.wire, movable=movable)
        if movable and handle.answered_by.chat_parser:
            # Its worker parses tools or reasoning from the stream: that state
            # stays there, and so does the stream, waiting out a stall.
            movable = False
            handle.mark_streaming()
        headers = self._headers(handle.answered_by)

        async def store(usage: protocol.Usage) -> None:
            if self.cached is not None:
                choices = len(self.builder.choices)
                await self.cached.store(usage, choices, handle.answered_by, headers)

        # From here a client that leaves is the cancellation or closing of this
        # body (EventStream), which aborts the request on its worker.
        body = relay(
            handle,
            first,
            self.builder,
            self.account,
            attempts.recorded,
            store,
            self._resume(attempts, target) if movable else None,
            self.settings.routing.max_migrations,
        )
        return EventStream(
            body,
            release=lambda: self._release_stream(handle),
            headers={**STREAM_HEADERS, **headers},
        )

    def _movable(self) -> bool:
        """Whether the request may go on on another worker mid-answer."""
        assert self.wire is not None
        return self.settings.routing.max_migrations > 0 and migration.movable(self.kind, self.wire)

    def _resume(self, attempts: Attempts, target: Target) -> migration.Resume:
        """How the stream goes on on another worker (``gateway.api.migration``)."""
        wire = self.wire
        assert wire is not None

        async def resume(
            continuation: protocol.Continuation, failed: str
        ) -> tuple[RequestHandle, protocol.Delta]:
            return await attempts.start(
                target,
                wire,
                continuation,
                avoid=frozenset({failed}) if failed else frozenset(),
                movable=True,
            )

        return resume

    def _headers(self, answered_by: Answerer) -> dict[str, str]:
        """Who answered: the worker, its served model and pool, the auto rule;
        the band it ran in, when not the first."""
        headers = answer_headers(
            answered_by,
            rule=self.target.rule if self.target is not None else "",
            cascade=self.cascade_outcome,
            cache=self.cached.result if self.cached is not None else "",
        )
        if self.band:
            headers[BAND_NAME] = protocol.BANDS[self.band]
        return headers

    def _release_stream(self, handle: RequestHandle) -> None:
        """The response is over and its generator never ran to its finally
        (the client left before the first write): abort and count it here."""
        if not self.account.done:
            handle.close()
            self.account.finish(499, handle.computed())
