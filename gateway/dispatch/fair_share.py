"""Fair sharing of worker slots between API keys under overload: a virtual token counter.

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024).
Each key (a tenant, by its id) has a counter of the service it received, in
tokens; a freed slot goes to the waiting request whose key's counter is the
smallest (first come first served among equals, and within a key). So a key
that floods the gateway gets its share of the slots, not all of them. A
request is charged its key's expected cost when it gets a slot, so a flood
is charged before any of it ends, and settled to its usage when it ends. A
key that becomes active starts level with the least-served active key: idle
time banks no credit. Requests without a key share one counter. It never
preempts a running request, and it shares only this process's slots; with
the limits in Redis (``gateway.tenants.fair_counters``) the counters are
every process's, and a request's ``rank`` orders it in the engine's queue.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Callable, Collection

# Tokens a request of a key is expected to cost before any of its key's (or
# any key's) requests has ended: only the order of the first charges
# depends on it; measured costs replace it from the first usage on.
DEFAULT_ESTIMATE = 256.0
# Weight of the newest request's tokens in a key's (and all keys') running mean.
_EWMA_WEIGHT = 0.2

Tenant = str | None
# A waiter: its place in arrival order, its future, the workers it must not use.
_Entry = tuple[int, "asyncio.Future[None]", Collection[str]]


def _any(_exclude: Collection[str]) -> bool:
    return True


class _Account:
    """One key's service received, and what is charged to it in advance."""

    __slots__ = ("active", "charged", "estimate", "outstanding", "served")

    def __init__(self, estimate: float) -> None:
        # Virtual tokens of service received (settled, and lifts); its
        # counter is this and what is charged in advance (``outstanding``).
        self.served = 0.0
        # Requests of this key waiting or running in this process.
        self.active = 0
        # Requests charged the expected cost and not yet settled, and that cost in all.
        self.charged = 0
        self.outstanding = 0.0
        # Expected tokens of its next request (running mean of its usage).
        self.estimate = estimate


class FairShare:
    """Every key's virtual token counter in this process: charged in advance,
    settled to usage, lifted when its key becomes active (no banked credit)."""

    def __init__(self) -> None:
        self._accounts: dict[Tenant, _Account] = {}
        # Where a key becoming active with none active starts.
        self._floor = 0.0
        # Mean tokens per request across keys: a new key's first estimate.
        self._mean = DEFAULT_ESTIMATE
        # Arrival order of waiters, for ties between keys.
        self._order = itertools.count()
        # Keys with a request waiting or running.
        self._active_keys = 0
        # Whether gateway.tenants.fair_counters keeps these counters level
        # with other processes' (and so what they have not heard is kept);
        # and whether they are every process's: only then do they rank
        # requests in the engines' queues, which every gateway feeds.
        self.kept_level = False
        self.shared = False
        # What other processes have not been told yet: tokens of service
        # settled here and lifts, per key; and the least counter of the keys
        # active in any process, as last heard (None: none, or not shared).
        self._added: dict[str, float] = {}
        self._lifted: dict[str, float] = {}
        self.active_min: float | None = None

    def _account(self, tenant: Tenant) -> _Account:
        account = self._accounts.get(tenant)
        if account is None:
            account = self._accounts[tenant] = _Account(self._mean)
        return account

    def counter(self, tenant: Tenant) -> float:
        account = self._accounts.get(tenant)
        return account.served + account.outstanding if account is not None else self._floor

    def rank(self, tenant: Tenant) -> int:
        """Where a request of ``tenant`` that just got its slot goes in its band
        in an engine's queue: its key's counter before that charge (0, first
        come first served, unless the counters are shared: one process's
        counters mean nothing beside another's)."""
        account = self._accounts.get(tenant)
        if not self.shared or account is None:
            return 0
        return max(0, int(account.served + account.outstanding - account.estimate))

    def ticket(self) -> int:
        """A waiter's place in arrival order (kept when it waits again after a wake-up)."""
        return next(self._order)

    def arrive(self, tenant: Tenant) -> None:
        """A request of ``tenant`` asks for a slot."""
        account = self._account(tenant)
        if account.active == 0:
            # Service the others received, not what they were charged in
            # advance (their estimates may be high: the newcomer would then
            # lose turns it is owed once they settle).
            lift = self._lift()
            if lift > account.served:
                account.served = lift
                if self.kept_level and tenant is not None:
                    self._lifted[tenant] = max(lift, self._lifted.get(tenant, 0.0))
            self._active_keys += 1
        account.active += 1

    def _lift(self) -> float:
        """Where a key that becomes active starts: level with the least-served key active here
        or (shared) anywhere, else the floor."""
        least = self.active_min
        if self._active_keys:
            here = min(a.served for a in self._accounts.values() if a.active)
            least = here if least is None else min(least, here)
        return self._floor if least is None else least

    def depart(self, tenant: Tenant) -> None:
        """A request of ``tenant`` left: refused before it had a slot, or ended."""
        account = self._accounts.get(tenant)
        if account is None or account.active == 0:
            return
        account.active -= 1
        if account.active == 0:
            self._active_keys -= 1
            if not self._active_keys:
                self._floor = max(self._floor, account.served)

    def charge(self, tenant: Tenant) -> None:
        """A request of ``tenant`` is given a slot: its expected cost, in advance."""
        account = self._account(tenant)
        account.outstanding += account.estimate
        account.charged += 1

    def refund(self, tenant: Tenant) -> None:
        """A request charged in advance did not take its slot after all."""
        self._settle(tenant, None, refund=True)

    def finished(self, tenant: Tenant, tokens: int | None) -> None:
        """A request of ``tenant`` ended; ``tokens``: its usage (None if it has none)."""
        self._settle(tenant, tokens, refund=False)
        self.depart(tenant)

    def _settle(self, tenant: Tenant, tokens: int | None, refund: bool) -> None:
        account = self._accounts.get(tenant)
        if account is None or account.charged == 0:
            return
        # The advance of one request: requests of one key are charged alike
        # but at different times (the estimate moves), so the mean of those
        # outstanding; once all are settled, the counter holds usage alone.
        advance = account.outstanding / account.charged
        account.outstanding -= advance
        account.charged -= 1
        # Woken but left without the slot: refunded. Ended without usage
        # (aborted, failed): the expected cost stays charged.
        if refund:
            return
        served = advance
        if tokens is not None:
            served = tokens
            account.estimate += _EWMA_WEIGHT * (tokens - account.estimate)
            self._mean += _EWMA_WEIGHT * (tokens - self._mean)
        account.served += served
        if self.kept_level and tenant is not None:
            self._added[tenant] = self._added.get(tenant, 0.0) + served

    # -- shared with the other processes (gateway.tenants.fair_counters) ----

    def exchange(self) -> list[tuple[str, float, float, bool]]:
        """What to tell the other processes, taken: per key (active here, or
        with news), the level it was lifted to, the service settled since the
        last exchange, and whether it is active here."""
        news = self._added.keys() | self._lifted.keys()
        told = [
            (tenant, self._lifted.get(tenant, 0.0), self._added.get(tenant, 0.0), bool(a.active))
            for tenant, a in self._accounts.items()
            if tenant is not None and (a.active or tenant in news)
        ]
        self._added.clear()
        self._lifted.clear()
        return told

    def untold(self, told: list[tuple[str, float, float, bool]]) -> None:
        """An exchange that did not reach the others: told again next time."""
        for tenant, lift, added, _ in told:
            if lift:
                self._lifted[tenant] = max(lift, self._lifted.get(tenant, 0.0))
            if added:
                self._added[tenant] = self._added.get(tenant, 0.0) + added

    def absorb(self, served: dict[str, float], active_min: float | None, floor: float) -> None:
        """What every process together says after an exchange: the service of
        the keys this process told of, the least of the keys active anywhere,
        and the floor. What happened here since the exchange stays on top."""
        for tenant, value in served.items():
            account = self._accounts.get(tenant)
            if account is not None:
                since = max(value, self._lifted.get(tenant, 0.0))
                account.served = since + self._added.get(tenant, 0.0)
        self.active_min = active_min
        self._floor = max(self._floor, floor)
        self.shared = True

    def unshared(self) -> None:
        """The other processes cannot be heard (Redis is down): this process's counters alone."""
        self.active_min = None


class FairQueue:
    """The requests waiting for one pool (or its low-priority line), by key: the
    next is the first of the key with the smallest counter that can use the
    free slot."""

    __slots__ = ("_lines", "_share")

    def __init__(self, share: FairShare) -> None:
        self._share = share
        # Per key, its waiters in order: (ticket, future, workers it must not
        # use). A done future is skipped (its request was woken by another
        # pool, left, or was woken).
        self._lines: dict[Tenant, collections.deque[_Entry]] = {}

    def append(
        self,
        waiter: asyncio.Future[None],
        tenant: Tenant,
        ticket: int,
        exclude: Collection[str] = (),
    ) -> None:
        self._line(tenant).append((ticket, waiter, exclude))

    def appendleft(
        self,
        waiter: asyncio.Future[None],
        tenant: Tenant,
        ticket: int,
        exclude: Collection[str] = (),
    ) -> None:
        """Back at the front of its key's line (woken, but the slot went elsewhere)."""
        self._line(tenant).appendleft((ticket, waiter, exclude))

    def __bool__(self) -> bool:
        """Whether any request may be waiting (a line may hold only left ones)."""
        return bool(self._lines)

    def _line(self, tenant: Tenant) -> collections.deque[_Entry]:
        line = self._lines.get(tenant)
        if line is None:
            line = self._lines[tenant] = collections.deque()
        return line

    def wake_one(self, usable: Callable[[Collection[str]], bool] = _any) -> bool:
        """Wake the next waiter that can use a free slot (``usable(exclude)``: a
        retry must not use the workers it already tried), charging its key in
        advance; False if none waits that can. Without the check, a waiter
        that cannot use the slot would be woken for it and go back to the
        queue, and the slot would stay idle while others wait for it."""
        best: Tenant = None
        best_rank: tuple[float, int] | None = None
        best_at = 0
        # Asked once for the waiters that exclude nothing (all but retries).
        anyone: bool | None = None

        def can_use(exclude: Collection[str]) -> bool:
            nonlocal anyone
            if exclude:
                return usable(exclude)
            if anyone is None:
                anyone = usable(())
            return anyone

        for tenant, line in list(self._lines.items()):
            while line and line[0][1].done():
                line.popleft()
            if not line:
                del self._lines[tenant]
                continue
            # The first of the key's waiters that can use it (almost always
            # the first of all: only retries exclude workers).
            at = next(
                (i for i, (_, w, ex) in enumerate(line) if not w.done() and can_use(ex)), None
            )
            if at is None:
                continue
            rank = (self._share.counter(tenant), line[at][0])
            if best_rank is None or rank < best_rank:
                best, best_rank, best_at = tenant, rank, at
        if best_rank is None:
            return False
        line = self._lines[best]
        _, waiter, _ = line[best_at]
        del line[best_at]
        self._share.charge(best)
        waiter.set_result(None)
        return True
