"""The keys' budgets' front door (``gateway.tenants.budgets``): reserve, settle, show.

Counted where the limiter counts (:class:`~gateway.tenants.limits.Limiter`):
in Redis while it answers, else in this process. A budget with no count yet
this period (a process that just started, a Redis that lost its data)
starts at what the key spent so far, by the usage table (``spent_so_far``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from gateway import errors
from gateway.tenants.budgets import (
    Cost,
    Hold,
    MemoryBudgets,
    Period,
    RedisBudgets,
    Refusal,
    Seeds,
    SpentSoFar,
    Standing,
    over_budget,
    periods,
    show,
)
from gateway.tenants.refusals import REFUSED
from shared.api_keys import KeyEntry
from shared.config import Price


class RedisHealth(Protocol):
    """Whether the limits' Redis answers, and what to tell it (the Limiter)."""

    failures: tuple[type[BaseException], ...]

    def uses_redis(self) -> bool: ...

    def redis_answered(self) -> None: ...

    def redis_failed(self, operation: str, exc: BaseException) -> None: ...

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None: ...


log = logging.getLogger(__name__)


class Spending:
    def __init__(self, limiter: RedisHealth, client: Any, clock: Callable[[], float]) -> None:
        self.limiter = limiter  # whether Redis answers, and the tasks to wait for
        # Budgets go by the calendar (UTC days and months): the wall clock.
        self.clock = clock
        self.memory = MemoryBudgets(clock)
        self.redis = RedisBudgets(client, clock) if client is not None else None
        # What a key spent so far this day and month, where its budgets have no
        # count yet (the app sets it: the usage table); None: nothing.
        self.spent_so_far: SpentSoFar | None = None
        self._seed_failed = False

    async def reserve(self, entry: KeyEntry, want: Cost, price: Price | None) -> Hold:
        """Take ``want`` from the key's budgets, or raise ``errors.OverBudget``."""
        taken = None
        now = self.clock()
        now_periods = periods(now)
        if self.limiter.uses_redis():
            assert self.redis is not None
            try:
                taken = await self.redis.reserve(entry, want, now)
                if taken is None:  # a count to start, once a period
                    start = await self._spent_so_far(entry, now_periods)
                    taken = await self.redis.reserve(entry, want, now, start)
                self.limiter.redis_answered()
            except self.limiter.failures as exc:
                self.limiter.redis_failed("budget", exc)
        shared = taken is not None
        if taken is None:
            if self.memory.missing(entry, now_periods):
                start = await self._spent_so_far(entry, now_periods)
                self.memory.seed(entry, now_periods, start)
            taken = self.memory.reserve(entry, want, now_periods)
        if isinstance(taken, Refusal):
            REFUSED.labels(entry.name, "budget").inc()
            raise over_budget(entry, taken, now)
        show(entry, taken.spent)
        return Hold(entry, taken.period_ids, want, price, shared)

    async def _spent_so_far(self, entry: KeyEntry, now_periods: dict[str, Period]) -> Seeds:
        """What the key spent so far this day and month (nothing if not known)."""
        zero = {"day": Cost(0, 0), "month": Cost(0, 0)}
        if self.spent_so_far is None:
            return zero
        try:
            spent = await self.spent_so_far(entry, now_periods)
        except errors.StateUnavailable as exc:
            if not self._seed_failed:
                self._seed_failed = True
                log.warning("budgets: counting from 0: the usage table is not there: %s", exc)
            return zero
        self._seed_failed = False
        return spent

    def settle(self, hold: Hold, delta: Cost) -> None:
        """Move the reservation ``hold`` by ``delta``, where it was made."""
        if not (delta.tokens or delta.micro_usd):
            return
        if not hold.shared:
            show(hold.entry, self.memory.add(hold.entry, hold.period_ids, delta))
            return
        self.limiter.spawn(self._settle_shared(hold, delta))

    async def _settle_shared(self, hold: Hold, delta: Cost) -> None:
        assert self.redis is not None
        try:
            spent = await self.redis.add(hold.entry, hold.period_ids, delta)
        except self.limiter.failures as exc:
            self.limiter.redis_failed("budget", exc)
            return
        show(hold.entry, spent)

    async def standing(self, entry: KeyEntry) -> list[Standing]:
        """Each of the key's budgets now, from where they are counted."""
        if entry.budget is None:
            return []
        if self.limiter.uses_redis():
            assert self.redis is not None
            try:
                return await self.redis.standing(entry)
            except self.limiter.failures as exc:
                self.limiter.redis_failed("budget", exc)
        return self.memory.standing(entry)
