"""Per-key limits: requests and tokens a minute and requests at once, for every process at once.

Once a request's model is resolved, before the response cache and admission
(``gateway.api.call``), :meth:`Limiter.admit` takes one request of its key,
a reservation of the tokens it may cost and, with ``max_concurrent``, a
running slot, or raises ``errors.RateLimited`` (429, ``Retry-After``): it
never queues. :class:`LimitScope` puts OpenAI's ``x-ratelimit-*`` headers on
the response and ends the :class:`Grant` however the request ended, settling
the reservation to what the engine computed (``gateway.api.accounting``).
Counts live in this process (``MemoryLimits``) or, with ``--limits``, in
Redis (``RedisLimits``) for every process and replica; while Redis does not
answer, each process limits on its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import errors
from gateway.context import RequestContext, context_of
from gateway.dispatch.fair_share import FairShare
from gateway.dispatch.models import Target
from gateway.tenants import budgets
from gateway.tenants.costs import choices_of, prompt_bound, reserved
from gateway.tenants.fair_counters import FairCounters
from gateway.tenants.redis_limits import LEASE_SECONDS, TIMEOUT, RedisLimits
from gateway.tenants.refusals import REFUSED, rate_headers, refusal
from gateway.tenants.spending import Spending
from gateway.tenants.windows import MemoryLimits
from shared import protocol
from shared.api_keys import KeyEntry
from shared.config import Price
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


def has_limits(entry: KeyEntry) -> bool:
    return bool(
        entry.requests_per_minute
        or entry.tokens_per_minute
        or entry.max_concurrent
        or entry.budget is not None
    )


class Grant:
    """One admitted request's hold on its key: its slot and its token reservation."""

    __slots__ = ("cost", "entry", "hold", "lease", "limiter", "shared", "tokens", "usage")

    def __init__(
        self,
        limiter: Limiter,
        entry: KeyEntry,
        cost: int,
        lease: str,
        shared: bool,
        hold: budgets.Hold | None = None,
    ) -> None:
        self.limiter = limiter
        self.entry = entry  # as it was at admission: a reload changes nothing here
        self.cost = cost
        self.lease = lease
        self.shared = shared  # counted in Redis, not in this process
        self.hold = hold  # its reservation in its key's budgets
        self.tokens: int | None = None  # what it cost, once known
        self.usage: tuple[int, int] = (0, 0)  # of which prompt, completion

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
        hold = self.hold
        if hold is not None and tokens is not None:
            prompt, completion = self.usage if ran else (0, 0)
            self.limiter.spending.settle(
                hold, budgets.cost(prompt, completion, hold.price) - hold.reserved
            )


class Limiter:
    """The front door to the limits store: Redis when set and answering, else memory."""

    def __init__(
        self,
        url: str = "",
        clock: Callable[[], float] = time.monotonic,
        timeout: float = TIMEOUT,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.memory = MemoryLimits(clock)
        self.redis = RedisLimits(url, timeout=timeout) if url else None
        # What a failed Redis call raises (redis is imported only when used).
        self.failures: tuple[type[BaseException], ...] = (OSError,)
        if url:
            from redis.exceptions import RedisError

            self.failures = (RedisError, OSError)
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
        # The keys' budgets: where the limits are (Redis or this process).
        self.spending = Spending(self, self.redis.client if self.redis else None, wall_clock)
        self.fair_counters: FairCounters | None = None

    async def start(self) -> None:
        if self.redis is not None:
            self._renewer = asyncio.create_task(self._renew_leases())

    def share_fairly(self, share: FairShare) -> None:
        """Keep fair sharing's counters (``share``) level with every process's,
        where the limits are: in Redis, when set; else they stay this process's."""
        if self.redis is not None:
            self.fair_counters = FairCounters(share, self, self.redis.client)
            self.fair_counters.start()

    async def stop(self) -> None:
        if self.fair_counters is not None:
            await self.fair_counters.stop()
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
        self,
        context: RequestContext,
        entry: KeyEntry,
        cost: Callable[[], tuple[int, int]],
        price: Price | None = None,
        bound: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        """Take one request of ``entry``'s and the tokens it may cost (``cost()``:
        prompt and completion, asked only with a tokens limit), and in its
        budgets at most what it can cost (``bound()``, else ``cost()``) at
        ``price``, or raise ``errors.RateLimited``."""
        hold = None
        if entry.budget is not None:
            most = (bound or cost)()
            hold = await self.spending.reserve(entry, budgets.cost(*most, price), price)
        try:
            tokens = sum(cost()) if entry.tokens_per_minute else 0
            await self._admit(context, entry, tokens, hold)
        except BaseException:
            if hold is not None:  # refused by a rate limit, or the client left
                self.spending.settle(hold, budgets.Cost(0, 0) - hold.reserved)
            raise

    async def _admit(
        self, context: RequestContext, entry: KeyEntry, tokens: int, hold: budgets.Hold | None
    ) -> None:
        lease = f"{self._process}:{next(self._leases)}"
        decision = None
        if self.uses_redis():
            assert self.redis is not None
            try:
                decision = await self.redis.admit(entry, tokens, lease)
                self.redis_answered()
            except self.failures as exc:
                self.redis_failed("admit", exc)
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
        grant = Grant(self, entry, tokens, lease, shared, hold)
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
        self.spawn(self._finish_shared(grant, delta, refund_request))

    async def _finish_shared(self, grant: Grant, delta: int, refund_request: bool) -> None:
        assert self.redis is not None
        try:
            await self.redis.release(grant.entry, grant.lease)
            await self.redis.settle(grant.entry, delta)
            if refund_request:
                await self.redis.refund_request(grant.entry)
        except self.failures as exc:
            self.redis_failed("finish", exc)

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
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
            except self.failures:
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
            except self.failures as exc:
                self.redis_failed("renew", exc)

    # -- Redis's health ------------------------------------------------------

    def uses_redis(self) -> bool:
        return self.redis is not None and (not self._down or self.clock() >= self._retry_at)

    def redis_failed(self, operation: str, exc: BaseException) -> None:
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

    def redis_answered(self) -> None:
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

    price = pool.names.price(target) if entry.budget is not None else None
    if price is None and budgets.needs_price(entry):
        raise errors.Forbidden(
            f"The API key {entry.name!r} has a budget in US dollars, and the model "
            f"`{target.model}` has no price in the pools file.",
            "model",
        )
    # The builder's choices, or what a forwarded body asks for (n, best_of, ...).
    sequences = max(choices, choices_of(raw))

    computed: list[tuple[int, int]] = []

    def cost() -> tuple[int, int]:
        """Worked out once, when a limit or a budget asks."""
        if computed:
            return computed[0]
        context = max(
            (w.max_model_len for w in pool.healthy_workers() if target.model in w.models),
            default=0,
        )
        # The prompt is estimated (``gateway.dispatch.models.CHARS_PER_TOKEN``)
        # unless the pools file's ``auto`` rules loaded a tokenizer: exact counting
        # would cost a tokenizer pass per request, and the reservation is settled anyway.
        computed.append(reserved(raw, pool.names.prompt_tokens(raw), context, sequences))
        return computed[0]

    def bound() -> tuple[int, int]:
        """A budget's reservation: the prompt's bound, never less than it costs."""
        return prompt_bound(raw), cost()[1]

    await limiter.admit(context, entry, cost, price, bound)


def settle(context: RequestContext, usage: protocol.Usage | None) -> None:
    """What the request cost, once known (None: a cache hit, which cost nothing)."""
    grant = context.grant
    if grant is not None:
        if usage is None:
            grant.tokens = 0
        else:
            grant.usage = (usage.prompt_tokens, usage.completion_tokens)
            grant.tokens = usage.prompt_tokens + usage.completion_tokens


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
