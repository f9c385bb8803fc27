"""Admission: which requests may go to a worker now, which wait, and which are refused.

A request takes a free slot in its home pool (a worker with fewer of this
process's requests in flight than its capacity), the routing policy choosing
among them; else it spills to a later tier (``gateway.dispatch.models``),
waits in a bounded queue, or is refused: 429 past the queue's bounds, 503
with ``Retry-After`` when no healthy worker serves its model. A freed slot
goes to the highest band (``protocol.BANDS``) with a waiter, and within it
to the waiter whose key received the least service lately
(``gateway.dispatch.fair_share``). The ``batch`` band (batch lines, batch
keys) takes only slots no other queued request needs and waits apart, so a
batch never makes another request a 429. Queues are per process, and a
running request is never preempted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from gateway import errors, metrics
from gateway.dispatch.fair_share import FairQueue, FairShare, Tenant
from gateway.dispatch.models import Tier
from gateway.dispatch.policies import Policy, RoutingContext
from gateway.dispatch.slots import Slots
from gateway.dispatch.work import WorkOrder
from gateway.dispatch.workers import Worker, Workers
from shared.protocol import BANDS, BATCH
from shared.settings import AdmissionSettings

log = logging.getLogger(__name__)

# Weight of the newest request time in a pool's running mean.
_EWMA_WEIGHT = 0.2


class _PoolQueue:
    """The requests waiting for one pool, in arrival order, and its recent request time."""

    __slots__ = (
        "depth_gauge",
        "in_flight_gauge",
        "lines",
        "mean_seconds",
        "queued",
        "tier",
    )

    def __init__(self, tier: Tier, share: FairShare) -> None:
        label = tier.label
        self.tier = tier
        # One line per band (``protocol.BANDS``), each a future per waiting
        # request by key (gateway.dispatch.fair_share); a line is woken only
        # when no line before it has a request that can use the slot.
        self.lines = tuple(FairQueue(share) for _ in BANDS)
        # Requests whose home this pool is, waiting.
        self.queued = 0
        self.mean_seconds = 0.0
        self.depth_gauge = metrics.child(metrics.POOL_QUEUE_DEPTH, label)
        self.in_flight_gauge = metrics.child(metrics.POOL_IN_FLIGHT, label)

    def wake_one(self, usable: Callable[[Collection[str]], bool]) -> bool:
        # Written out, not a loop: it runs at the end of every request.
        interactive, standard, batch = self.lines
        return interactive.wake_one(usable) or standard.wake_one(usable) or batch.wake_one(usable)

    def waiting(self) -> bool:
        """Whether any request may be waiting here (False: none is)."""
        interactive, standard, batch = self.lines
        return bool(interactive) or bool(standard) or bool(batch)


class Admission:
    def __init__(self, settings: AdmissionSettings, workers: Workers, policy: Policy) -> None:
        self.settings = settings
        self.workers = workers
        self.policy = policy
        self.slots = Slots(settings, workers)
        # Requests waiting in this process's queues, all pools together.
        self.queued = 0
        self._pools: dict[str, _PoolQueue] = {}
        # Every key's service received, in this process.
        self.fair = FairShare()
        self._fair_share = settings.fair_share

    def pool(self, tier: Tier) -> _PoolQueue:
        queue = self._pools.get(tier.label)
        if queue is None:
            queue = self._pools[tier.label] = _PoolQueue(tier, self.fair)
        return queue

    def _tenant(self, tenant: Tenant) -> Tenant:
        """The key a request is shared by: none (one line for all) without fair sharing."""
        return tenant if self._fair_share else None

    def rank(self, tenant: Tenant) -> int:
        """A request's place in its band in an engine's queue, once it has its slot."""
        return self.fair.rank(self._tenant(tenant))

    async def acquire(
        self,
        order: WorkOrder,
        exclude: Collection[str] = (),
        on_queued: Callable[[], object] | None = None,
    ) -> tuple[Worker, Tier]:
        """A worker with a free slot for the order's target, chosen by the
        policy (by the order's routing key), and its tier; queues if none may
        take it now (and calls ``on_queued`` then), until the order's deadline.
        A ``low_priority`` order goes after every interactive request; its
        ``tenant`` (the API key's id) is what fair sharing shares slots
        between, and the pool tells :meth:`finished` the same when it ends."""
        tenant = self._tenant(order.tenant)
        self.fair.arrive(tenant)
        try:
            return await self._acquire(order, exclude, on_queued, tenant)
        except BaseException:
            self.fair.depart(tenant)
            raise

    async def _acquire(
        self,
        order: WorkOrder,
        exclude: Collection[str],
        on_queued: Callable[[], object] | None,
        tenant: Tenant,
    ) -> tuple[Worker, Tier]:
        target = order.pools
        low_priority = order.band == BATCH
        # No healthy worker at all: wait up to --startup-timeout for one, then 503.
        if not self.workers.any_healthy and not await self.workers.wait_for_any():
            metrics.REJECTED.labels("no_worker").inc()
            if target.declared:
                raise self.slots.not_ready(target)
            raise errors.NoWorker("No worker is available yet; try again shortly.")
        tried = None
        if not low_priority:
            # The common case first: a free slot in the first tier's pool and
            # nobody queued there (that tier is then live, so the home tier).
            tried = target.tiers[0]
            queue = self._pools.get(tried.label)  # not made here: the tier may not exist
            if queue is None or not queue.queued:
                chosen = self._take(tried, order, exclude)
                if chosen is not None:
                    self.fair.charge(tenant)
                    return chosen
        tiers = self.slots.live_tiers(target, exclude)
        home = tiers[0]
        home_queue = self.pool(home)
        if low_priority:
            chosen = self._take_spare(home, order, exclude)
            if chosen is not None:
                self.fair.charge(tenant)
                return chosen
            if on_queued is not None:
                on_queued()
            return await self._wait_low(home, order, exclude, tenant)
        if not home_queue.queued and home is not tried:  # else those first
            chosen = self._take(home, order, exclude)
            if chosen is not None:
                self.fair.charge(tenant)
                return chosen
        # Without spill_after a request only ever runs on its home pool; with it,
        # one that would wait at least that long starts at once on a later tier.
        spill_after = home.spill_after if len(tiers) > 1 else None
        if spill_after is not None and self.expected_wait(home) >= spill_after:
            chosen = self._spill(tiers, order, exclude)
            if chosen is not None:
                self.fair.charge(tenant)
                return chosen
        if self.queued >= self.settings.max_queue:
            metrics.REJECTED.labels("queue_full").inc()
            raise errors.Overloaded(
                "Too many requests are waiting; try again shortly.", retry_after=1
            )
        return await self._wait(order, tiers, exclude, on_queued, tenant)

    async def _wait(
        self,
        order: WorkOrder,
        tiers: list[Tier],
        exclude: Collection[str],
        on_queued: Callable[[], object] | None,
        tenant: Tenant,
    ) -> tuple[Worker, Tier]:
        """Queue in the order's band's line for the home pool (and, after
        ``spill_after``, the later tiers')."""
        deadline, band = order.deadline, order.band
        wait = self.settings.queue_timeout
        if deadline:
            wait = min(wait, deadline - time.time())
        now = time.monotonic()
        give_up = now + wait
        home = tiers[0]
        home_queue = self.pool(home)
        spill_after = home.spill_after if len(tiers) > 1 else None
        spill_at = now + spill_after if spill_after is not None else None
        if on_queued is not None:
            on_queued()
        self.queued += 1
        home_queue.queued += 1
        metrics.add(metrics.QUEUE_DEPTH)
        metrics.add(home_queue.depth_gauge)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        ticket = self.fair.ticket()
        home_queue.lines[band].append(waiter, tenant, ticket, exclude)
        chosen = None
        spilling = False
        try:
            while True:
                now = time.monotonic()
                # Woken first: the slot it was woken for is taken before any
                # spill-over, or that slot would stay free with nobody told.
                if waiter.done():
                    chosen = self._take(home, order, exclude)
                    if chosen is None and spilling:
                        chosen = self._spill(tiers, order, exclude)
                    if chosen is not None:
                        return chosen
                    # Woken, but the slot went elsewhere (or was a general
                    # wake-up): wait again, at the front of its key's line.
                    self.fair.refund(tenant)
                    waiter = loop.create_future()
                    home_queue.lines[band].appendleft(waiter, tenant, ticket, exclude)
                    if spilling:
                        for tier in tiers[1:]:
                            line = self.pool(tier).lines[band]
                            line.appendleft(waiter, tenant, ticket, exclude)
                if not spilling and spill_at is not None and now >= spill_at:
                    # Waited long enough: a later tier's slot will do too.
                    spilling = True
                    chosen = self._spill(tiers, order, exclude)
                    if chosen is not None:
                        return chosen
                    for tier in tiers[1:]:
                        self.pool(tier).lines[band].append(waiter, tenant, ticket, exclude)
                remaining = give_up - now
                if remaining <= 0:
                    metrics.REJECTED.labels("queue_timeout").inc()
                    raise errors.Overloaded(
                        "Timed out waiting for a free worker; try again shortly.", retry_after=1
                    )
                if spill_at is not None and not spilling:
                    remaining = min(remaining, spill_at - now)
                try:
                    async with asyncio.timeout(remaining):
                        await asyncio.shield(waiter)
                except TimeoutError:
                    continue
        finally:
            self.queued -= 1
            home_queue.queued -= 1
            metrics.add(metrics.QUEUE_DEPTH, -1)
            metrics.add(home_queue.depth_gauge, -1)
            self._leave(waiter, chosen is not None, tiers, tenant)

    async def _wait_low(
        self,
        home: Tier,
        order: WorkOrder,
        exclude: Collection[str],
        tenant: Tenant,
    ) -> tuple[Worker, Tier]:
        """Queue behind every interactive request for ``home`` alone (no spill-over):
        a freed slot wakes it only when no interactive request waits there. It
        waits until its deadline, not ``--queue-timeout``, and outside
        ``--max-queue``, so a batch never makes an interactive request a 429."""
        deadline = order.deadline
        queue = self.pool(home)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        ticket = self.fair.ticket()
        queue.lines[BATCH].append(waiter, tenant, ticket, exclude)
        chosen = None
        try:
            while True:
                if waiter.done():
                    chosen = self._take_spare(home, order, exclude)
                    if chosen is not None:
                        return chosen
                    self.fair.refund(tenant)
                    waiter = loop.create_future()
                    queue.lines[BATCH].appendleft(waiter, tenant, ticket, exclude)
                remaining = deadline - time.time() if deadline else None
                if remaining is not None and remaining <= 0:
                    metrics.REJECTED.labels("queue_timeout").inc()
                    raise errors.Overloaded(
                        "Timed out waiting for a spare worker slot; try again later.",
                        retry_after=1,
                    )
                try:
                    async with asyncio.timeout(remaining):
                        await asyncio.shield(waiter)
                except TimeoutError:
                    continue
        finally:
            self._leave(waiter, chosen is not None, [home], tenant)

    def _leave(
        self, waiter: asyncio.Future[None], took_slot: bool, tiers: list[Tier], tenant: Tenant
    ) -> None:
        """A queued request leaves its queue, with a slot or without."""
        if not waiter.done():
            waiter.cancel()  # skipped where it is still queued
            if took_slot:
                # A later tier's slot, taken without a wake-up (spill-over).
                self.fair.charge(tenant)
        elif not took_slot:
            # Woken, but leaving without the slot (refused, cancelled, its
            # client gone): the wake-up goes to the next in line.
            self.fair.refund(tenant)
            self.wake_pools(tiers)

    def _take_spare(
        self, tier: Tier, order: WorkOrder, exclude: Collection[str]
    ) -> tuple[Worker, Tier] | None:
        """A free slot of ``tier`` for a low-priority request: only one that no
        interactive request queued for the pool will need."""
        free = self.slots.free(tier, exclude)
        spare = sum(self.slots.capacity_of(w) - w.in_flight for w in free)
        if spare <= self.pool(tier).queued:
            return None
        return self.policy.select(RoutingContext(free, order.key, tier.model, order)), tier

    def capacity(self) -> int:
        """Slots of the healthy workers, all pools together."""
        return sum(self.slots.capacity_of(w) for w in self.workers.healthy())

    def serves(self, tier: Tier) -> bool:
        """Whether any worker may take a request for ``tier`` now (slots aside)."""
        return self.slots.serves(tier)

    def _take(
        self, tier: Tier, order: WorkOrder, exclude: Collection[str]
    ) -> tuple[Worker, Tier] | None:
        """A free worker of ``tier``, chosen by the policy; None if none."""
        free = self.slots.free(tier, exclude)
        if not free:
            return None
        return self.policy.select(RoutingContext(free, order.key, tier.model, order)), tier

    def _spill(
        self, tiers: list[Tier], order: WorkOrder, exclude: Collection[str]
    ) -> tuple[Worker, Tier] | None:
        for tier in tiers[1:]:
            free = self.slots.free(tier, exclude)
            if free:
                metrics.child(metrics.SPILLOVER, tiers[0].label, tier.label).inc()
                log.debug(
                    "spill-over: %s is full, %s takes the request", tiers[0].label, tier.label
                )
                return self.policy.select(RoutingContext(free, order.key, tier.model, order)), tier
        return None

    def expected_wait(self, tier: Tier) -> float:
        """Seconds a request arriving now would wait for ``tier``'s pool (an estimate)."""
        queue = self.pool(tier)
        slots = sum(self.slots.capacity_of(w) for w in self.slots.serving(tier, ()))
        return (queue.queued + 1) / max(slots, 1) * queue.mean_seconds

    def finished(
        self,
        tier: Tier,
        seconds: float | None,
        tenant: Tenant = None,
        tokens: int | None = None,
    ) -> None:
        """A request on ``tier`` ended (after ``seconds``, if it ran to its end):
        its pool's mean request time, and a free slot. ``tenant``: the key it
        was admitted for; ``tokens``: its usage (prompt + completion), when
        the engine reported one, charged to that key."""
        queue = self.pool(tier)
        if seconds is not None:
            queue.mean_seconds += _EWMA_WEIGHT * (seconds - queue.mean_seconds)
        self.fair.finished(self._tenant(tenant), tokens)
        metrics.add(queue.in_flight_gauge, -1)
        self.wake_pools([tier])

    def unused(self, tier: Tier, tenant: Tenant) -> None:
        """A request given a slot did not go to the worker after all (it could
        not be sent): not charged, and the slot is free for the next."""
        tenant = self._tenant(tenant)
        self.fair.refund(tenant)
        self.fair.depart(tenant)
        self.wake_pools([tier])

    def started(self, tier: Tier) -> None:
        metrics.add(self.pool(tier).in_flight_gauge)

    def wake_pools(self, tiers: Collection[Tier]) -> None:
        """One queued request of the first of ``tiers`` with any that can use a
        free slot there may look for it."""
        for tier in tiers:
            queue = self._pools.get(tier.label)
            if queue is not None and queue.waiting() and queue.wake_one(self._usable(tier)):
                return

    def wake(self) -> None:
        """A worker came up: as many queued requests as there are free slots in
        each pool look for one (the first in line; the rest keep their place)."""
        for queue in self._pools.values():
            free = sum(
                self.slots.capacity_of(w) - w.in_flight for w in self.slots.free(queue.tier, ())
            )
            for _ in range(free):
                if not queue.wake_one(self._usable(queue.tier)):
                    break

    def _usable(self, tier: Tier) -> Callable[[Collection[str]], bool]:
        """Whether a waiter that must not use the workers ``exclude`` (a retry)
        finds a free slot of ``tier``."""
        return lambda exclude: bool(self.slots.free(tier, exclude))
