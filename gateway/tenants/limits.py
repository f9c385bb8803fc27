"""Per-key limits: requests and tokens a minute and requests at once, for every process at once.

A request whose API key (``shared.api_keys.KeyEntry``) has limits is
admitted here once its model is resolved, before the response cache and
admission (``gateway.api.call``): :meth:`Limiter.admit` takes one request,
its token reservation and, with ``max_concurrent``, a running slot, or
raises ``errors.RateLimited`` (429, ``Retry-After``). Its :class:`Grant`
goes in the request's context; :class:`LimitScope` around the app puts OpenAI's
``x-ratelimit-*`` headers on the response's first message, whatever it is
(an answer, a stream, a cache hit, an error, the 429 itself), and ends the
grant when the app returns, however the request ended: the slot is given
back and the tokens settled.

Tokens are counted before the request runs: its prompt (estimated at
``gateway.dispatch.models.CHARS_PER_TOKEN`` characters a token, or counted with the
tokenizer the pools file's ``auto`` rules load: exact counting would cost a
tokenizer pass per request, and the estimate is settled anyway) plus what
it may generate: ``max_tokens`` (``max_completion_tokens``,
``max_output_tokens``) per choice, or the rest of the model's context (as
its workers report it) when it sets none. When the request ends the
reservation is settled to the worker's count (prompt + completion tokens);
a request refused before it ran (an error status) gives its tokens back,
and so does a cache hit, which costs no GPU time; one the gateway itself
could not serve (503: no worker, its model not ready; 429: the queue full)
gives its request back too, since the key did nothing wrong. A request that
ended early (a client gone, a stream cut) pays what the engine computed
(``gateway.api.accounting``); one that left before any count came (499)
keeps its reservation.

Where the counts live: in this process (``MemoryLimits``, the default), or
in Redis with ``--limits redis://HOST:PORT/DB`` (``RedisLimits``: every
process and replica shares them). While Redis does not answer the gateway
limits each process on its own, logs that once (and once when Redis is
back), counts each failure in ``llmgate_limits_store_errors_total``, and
tries Redis again every ``RETRY_SECONDS``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import errors
from gateway.context import RequestContext, context_of
from gateway.dispatch.models import Target
from gateway.tenants.redis_limits import LEASE_SECONDS, TIMEOUT, RedisLimits
from gateway.tenants.windows import CONCURRENT, TOO_LARGE, Decision, MemoryLimits
from shared import protocol
from shared.api_keys import KeyEntry
from shared.redact import redact_url

log = logging.getLogger(__name__)

# The status the gateway logs for a request whose client left before its answer.
CLIENT_LEFT = 499
# The gateway's own refusals of an admitted request (no worker, its model not
# ready, the queue full): the key's request is given back with its tokens.
GATEWAY_REFUSED = frozenset({429, 503})
# Seconds between attempts to reach a Redis that did not answer.
RETRY_SECONDS = 5.0

STORE_ERRORS = Counter(
    "llmgate_limits_store_errors",
    "Limits store (Redis) operations that failed, by operation: the request was "
    "limited by this process's own counts instead.",
    ["operation"],
)
REFUSED = Counter(
    "llmgate_limits_refused",
    "Requests refused with 429 by their API key's limits, by key name and limit "
    "(requests, tokens, concurrent, too_large).",
    ["key", "limit"],
)

# The fields that carry a prompt: chat, completions, the Responses API.
_PROMPT_FIELDS = ("messages", "prompt", "input")
_LABELS = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}


def has_limits(entry: KeyEntry) -> bool:
    return bool(entry.requests_per_minute or entry.tokens_per_minute or entry.max_concurrent)


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI's reset headers write it: ``20ms``, ``1s``, ``1.5s``, ``6m0s``."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    text = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


def rate_headers(entry: KeyEntry, decision: Decision) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for the key's windows (none for a limit it has not)."""
    headers = {}
    if entry.requests_per_minute:
        headers["x-ratelimit-limit-requests"] = str(entry.requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(decision.remaining_requests)
        headers["x-ratelimit-reset-requests"] = duration(decision.reset_requests)
    if entry.tokens_per_minute:
        headers["x-ratelimit-limit-tokens"] = str(entry.tokens_per_minute)
        headers["x-ratelimit-remaining-tokens"] = str(decision.remaining_tokens)
        headers["x-ratelimit-reset-tokens"] = duration(decision.reset_tokens)
    return headers


def reservation(raw: dict[str, Any], prompt_tokens: int, context: int, choices: int) -> int:
    """Tokens a request may cost: its prompt, and per choice what it may generate
    (its ``max_tokens``, else the rest of the ``context``; 0 = not known). A body
    with no prompt at all (vLLM's ``/version``, ``/ping``) generates nothing."""
    asked = next(
        (
            raw[name]
            for name in ("max_tokens", "max_completion_tokens", "max_output_tokens")
            if isinstance(raw.get(name), int) and raw[name] > 0
        ),
        None,
    )
    room = max(context - prompt_tokens, 0) if context else None
    if asked is None:
        generated = (room or 0) if any(k in raw for k in _PROMPT_FIELDS) else 0
    else:
        generated = asked if room is None else min(asked, room)
    return prompt_tokens + generated * max(choices, 1)


def choices_of(raw: dict[str, Any]) -> int:
    """How many sequences a request may generate: ``n`` (or ``best_of``, when
    larger) for each of its prompts (a completions list of several, or the
    conversations of vLLM's ``/v1/chat/completions/batch``)."""
    width = max(
        (v for v in (raw.get("n"), raw.get("best_of")) if type(v) is int and v > 0), default=1
    )
    prompts = 1
    for name in ("prompt", "messages"):
        value = raw.get(name)
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            prompts = len(value) if name == "prompt" or isinstance(value[0], list) else 1
    return width * prompts


def refusal(entry: KeyEntry, decision: Decision, cost: int) -> errors.RateLimited:
    """The 429 for a refused ``decision``, worded as OpenAI words its own."""
    name = entry.name
    if decision.refused_by == TOO_LARGE:
        return errors.RateLimited(
            f"Request too large for the API key {name!r} on tokens per min (TPM): "
            f"Limit {entry.tokens_per_minute}, Requested {cost}. Reduce the prompt "
            "or max_tokens.",
            None,
            "tokens",
        )
    wait = math.ceil(decision.retry_after or 1)
    if decision.refused_by == CONCURRENT:
        return errors.RateLimited(
            f"Concurrency limit reached for the API key {name!r}: Limit "
            f"{entry.max_concurrent} requests at once. Please try again when one ends.",
            wait,
        )
    if decision.refused_by == "requests":
        limit, remaining, requested = entry.requests_per_minute, decision.remaining_requests, 1
    else:
        limit, remaining, requested = entry.tokens_per_minute, decision.remaining_tokens, cost
    return errors.RateLimited(
        f"Rate limit reached for the API key {name!r} on {_LABELS[decision.refused_by]}: "
        f"Limit {limit}, Used {limit - remaining}, Requested {requested}. "
        f"Please try again in {duration(decision.retry_after or 0)}.",
        wait,
        "tokens" if decision.refused_by == "tokens" else "requests",
    )


class Grant:
    """One admitted request's hold on its key: its slot and its token reservation."""

    __slots__ = ("cost", "entry", "lease", "limiter", "shared", "tokens")

    def __init__(
        self, limiter: Limiter, entry: KeyEntry, cost: int, lease: str, shared: bool
    ) -> None:
        self.limiter = limiter
        self.entry = entry  # as it was at admission: a reload changes nothing here
        self.cost = cost
        self.lease = lease
        self.shared = shared  # counted in Redis, not in this process
        self.tokens: int | None = None  # what it cost, once known

    def end(self, status: int | None) -> None:
        """Give the slot back and settle the tokens; ``status``: the response's
        (None: it never started)."""
        tokens = self.tokens
        ran = tokens is not None
        if tokens is None and (status is None or status >= 400) and status != CLIENT_LEFT:
            tokens = 0  # it never ran: nothing to pay for
        # A client that left (499) keeps its reservation: the engine may have
        # done the work, and a client timing out must not make it free.
        delta = 0 if tokens is None else tokens - self.cost
        self.limiter.finish(self, delta, refund_request=not ran and status in GATEWAY_REFUSED)


class Limiter:
    """The front door to the limits store: Redis when set and answering, else memory."""

    def __init__(
        self,
        url: str = "",
        clock: Callable[[], float] = time.monotonic,
        timeout: float = TIMEOUT,
    ) -> None:
        self.memory = MemoryLimits(clock)
        self.redis = RedisLimits(url, timeout=timeout) if url else None
        # What a failed Redis call raises (redis is imported only when used).
        self._failures: tuple[type[BaseException], ...] = (OSError,)
        if url:
            from redis.exceptions import RedisError

            self._failures = (RedisError, OSError)
        self.clock = clock
        self._retry_at = 0.0  # while Redis is down: when to try it again
        self._down = False
        self._process = uuid.uuid4().hex[:12]
        self._leases = itertools.count()
        self._held: dict[str, Grant] = {}  # Redis leases this process renews
        # Leases an unanswered admission may have taken: released when Redis answers.
        self._orphans: dict[str, tuple[KeyEntry, float]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.redis is not None:
            self._renewer = asyncio.create_task(self._renew_leases())

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        await self.drain()
        if self.redis is not None:
            await self.redis.close()

    async def drain(self) -> None:
        """Wait for the releases and settlements under way (to Redis)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def admit(
        self, context: RequestContext, entry: KeyEntry, cost: Callable[[], int]
    ) -> None:
        """Take one request of ``entry``'s and its ``cost()`` tokens (called only
        with a tokens limit), or raise ``errors.RateLimited``."""
        tokens = cost() if entry.tokens_per_minute else 0
        lease = f"{self._process}:{next(self._leases)}"
        decision = None
        if self._uses_redis():
            assert self.redis is not None
            try:
                decision = await self.redis.admit(entry, tokens, lease)
                self._redis_answered()
            except self._failures as exc:
                self._redis_failed("admit", exc)
                self._orphaned(entry, lease)
            except asyncio.CancelledError:
                self._orphaned(entry, lease)  # the client left while Redis answered
                raise
        shared = decision is not None
        if decision is None:
            decision = self.memory.admit(entry, tokens)
        context.rate_headers = rate_headers(entry, decision)
        if not decision.allowed:
            REFUSED.labels(entry.name, decision.refused_by).inc()
            raise refusal(entry, decision, tokens)
        grant = Grant(self, entry, tokens, lease, shared)
        if shared and entry.max_concurrent:
            self._held[lease] = grant
        context.grant = grant

    def finish(self, grant: Grant, delta: int, refund_request: bool = False) -> None:
        if not grant.shared:
            self.memory.settle(grant.entry, delta)
            if refund_request:
                self.memory.refund_request(grant.entry)
            if grant.entry.max_concurrent:
                self.memory.release(grant.entry)
            return
        self._held.pop(grant.lease, None)
        # In the background: the response is over, and a Redis that is slow
        # must not hold the request's task (its lease lapses if this fails).
        self._spawn(self._finish_shared(grant, delta, refund_request))

    async def _finish_shared(self, grant: Grant, delta: int, refund_request: bool) -> None:
        assert self.redis is not None
        try:
            await self.redis.release(grant.entry, grant.lease)
            await self.redis.settle(grant.entry, delta)
            if refund_request:
                await self.redis.refund_request(grant.entry)
        except self._failures as exc:
            self._redis_failed("finish", exc)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _orphaned(self, entry: KeyEntry, lease: str) -> None:
        """An admission whose answer from Redis never came: its script may have
        run and taken a slot this process will never release. Released once
        Redis answers (until the lease would have lapsed anyway), so the key
        is not held at its max_concurrent by slots nobody uses."""
        if entry.max_concurrent:
            self._orphans[lease] = (entry, self.clock() + LEASE_SECONDS)

    async def _release_orphans(self) -> None:
        assert self.redis is not None
        for lease, (entry, lapses) in list(self._orphans.items()):
            if self.clock() >= lapses:
                del self._orphans[lease]
                continue
            try:
                await self.redis.release(entry, lease)
            except self._failures:
                return  # still away: tried again at the next renewal
            del self._orphans[lease]

    async def _renew_leases(self) -> None:
        assert self.redis is not None
        while True:
            await asyncio.sleep(LEASE_SECONDS / 3)
            held: dict[str, list[str]] = {}
            for lease, grant in list(self._held.items()):
                held.setdefault(grant.entry.id, []).append(lease)
            if self._orphans:
                await self._release_orphans()
            if not held:
                continue
            try:
                await self.redis.renew(held)
            except self._failures as exc:
                self._redis_failed("renew", exc)

    # -- Redis's health ------------------------------------------------------

    def _uses_redis(self) -> bool:
        return self.redis is not None and (not self._down or self.clock() >= self._retry_at)

    def _redis_failed(self, operation: str, exc: BaseException) -> None:
        STORE_ERRORS.labels(operation).inc()
        self._retry_at = self.clock() + RETRY_SECONDS
        if not self._down:
            self._down = True
            log.warning(
                "limits: Redis at %s does not answer (%s): limiting each process on its own "
                "until it does",
                redact_url(self.redis.url) if self.redis else "",
                exc,
            )

    def _redis_answered(self) -> None:
        if self._down:
            self._down = False
            log.warning("limits: Redis answers again: limits are shared again")


async def admit(
    limiter: Limiter | None,
    context: RequestContext,
    pool: Any,
    target: Target,
    raw: dict[str, Any],
    choices: int,
) -> None:
    """Count the request against its key's limits (nothing for a key with none):
    ``gateway.api.call``'s one step, once the model is resolved."""
    entry = context.key
    if entry is None or not has_limits(entry) or limiter is None:
        return

    def cost() -> int:
        context = max(
            (w.max_model_len for w in pool.healthy_workers() if target.model in w.models),
            default=0,
        )
        # The builder's choices, or what a forwarded body asks for (n, best_of, ...).
        sequences = max(choices, choices_of(raw))
        return reservation(raw, pool.names.prompt_tokens(raw), context, sequences)

    await limiter.admit(context, entry, cost)


def settle(context: RequestContext, usage: protocol.Usage | None) -> None:
    """What the request cost, once known (None: a cache hit, which cost nothing)."""
    grant = context.grant
    if grant is not None:
        grant.tokens = 0 if usage is None else usage.prompt_tokens + usage.completion_tokens


class LimitScope:
    """Puts a limited key's ``x-ratelimit-*`` headers on its response, and ends
    its grant once the app is done with the request, however it ended."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None
        context = context_of(scope)

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                extra = context.rate_headers
                if extra:
                    added = [(k.encode(), v.encode()) for k, v in extra.items()]
                    message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            if context.grant is not None:
                context.grant.end(status)
