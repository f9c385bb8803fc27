"""Spend budgets per key: tokens or US dollars over a UTC day and a calendar month.

A request of a key with a ``budget`` (``shared.api_keys.Budget``) reserves,
before it runs, what it may cost in each of the key's budgets for the
current UTC day and month: the token limit's reservation (prompt + most
completion), and in dollars that at its model's price (``shared.config.Price``).
A budget it would pass refuses it (429 ``insufficient_quota``, with when the
budget resets). When it ends the reservation is settled to the engine's
count, in the periods it was reserved in. A reservation checks and takes
every budget of the key at once (one process: on its event loop; Redis: one
Lua script), so concurrent requests through any number of gateways spend
past a budget only by what settlement adds beyond their reservations.

Dollars are counted in micro-dollars, as integers: a price in dollars per
million tokens is micro-dollars per token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import Gauge

from gateway import errors
from shared.api_keys import Budget, KeyEntry
from shared.config import Price

if TYPE_CHECKING:
    from gateway.state import State

REMAINING = Gauge(
    "llmgate_key_budget_remaining",
    "What an API key may still spend of a budget this period (tokens, or US dollars), "
    "as this process last saw it, by key name and budget (tokens_per_day, usd_per_month, ...).",
    ["key", "budget"],
    multiprocess_mode="mostrecent",
)

PERIODS = ("day", "month")
MICRO = 1_000_000
# Seconds a Redis counter outlives its period: long enough for requests
# reserved in it to settle, short enough not to keep every period forever.
KEPT_AFTER = 2 * 24 * 3600


@dataclass(frozen=True, slots=True)
class Period:
    """A UTC day (``2026-12-06``) or calendar month (``2026-12``) and when it ends."""

    name: str
    id: str
    ends_at: float


def periods(now: float) -> dict[str, Period]:
    """The day and the month ``now`` (Unix time) falls in, in UTC."""
    moment = datetime.fromtimestamp(now, UTC)
    day = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    month = day.replace(day=1)
    if month.month == 12:
        next_month = month.replace(year=month.year + 1, month=1)
    else:
        next_month = month.replace(month=month.month + 1)
    return {
        "day": Period("day", day.strftime("%Y-%m-%d"), day.timestamp() + 24 * 3600),
        "month": Period("month", month.strftime("%Y-%m"), next_month.timestamp()),
    }


@dataclass(frozen=True, slots=True)
class Cost:
    """What a request may cost, or did: tokens and micro-dollars."""

    tokens: int
    micro_usd: int

    def __sub__(self, other: Cost) -> Cost:
        return Cost(self.tokens - other.tokens, self.micro_usd - other.micro_usd)


def cost(prompt_tokens: int, completion_tokens: int, price: Price | None) -> Cost:
    """The cost of so many tokens at ``price`` (None: no dollars)."""
    micro = 0
    if price is not None:
        micro = math.ceil(prompt_tokens * price.input + completion_tokens * price.output)
    return Cost(prompt_tokens + completion_tokens, micro)


@dataclass(frozen=True, slots=True)
class Limit:
    """One of a key's budgets: ``field`` as the keys file names it."""

    field: str
    unit: str  # tokens or usd
    period: str  # day or month
    amount: int  # tokens, or micro-dollars

    def of(self, spend: Cost) -> int:
        return spend.tokens if self.unit == "tokens" else spend.micro_usd

    def scaled(self, amount: int) -> float:
        """``amount`` in the budget's unit: tokens, or dollars."""
        return amount / MICRO if self.unit == "usd" else amount

    def shown(self, amount: int) -> str:
        return f"${amount / MICRO:,.2f}" if self.unit == "usd" else f"{amount:,} tokens"


def limits_of(budget: Budget) -> list[Limit]:
    """The budgets a key has (a 0 is none)."""
    out = []
    for unit in ("tokens", "usd"):
        for period in PERIODS:
            field = f"{unit}_per_{period}"
            value = getattr(budget, field)
            if value:
                amount = round(value * MICRO) if unit == "usd" else int(value)
                out.append(Limit(field, unit, period, amount))
    return out


def needs_price(entry: KeyEntry) -> bool:
    budget = entry.budget
    return budget is not None and bool(budget.usd_per_day or budget.usd_per_month)


@dataclass(frozen=True, slots=True)
class Refusal:
    """The budget a reservation would pass, how much of it is spent, and when it resets."""

    limit: Limit
    spent: int
    requested: int
    ends_at: float


# What a key spent so far in each period ("day", "month"): a budget's count
# starts there when it has none (a new process, a Redis that lost its data).
Seeds = dict[str, Cost]


@dataclass(frozen=True, slots=True)
class Taken:
    """A reservation made: the period ids it was made in, and each budget's
    spend after it (in ``limits_of``'s order)."""

    period_ids: dict[str, str]
    spent: list[int]


@dataclass(slots=True)
class Hold:
    """One admitted request's reservation: settled once it ends."""

    entry: KeyEntry
    # The period ids it was reserved in: it settles there, even past midnight.
    period_ids: dict[str, str]
    reserved: Cost
    price: Price | None
    shared: bool  # reserved in Redis, not in this process


@dataclass(frozen=True, slots=True)
class Standing:
    """One budget's state: for ``/v1/usage``, ``llmgate keys list`` and the gauge."""

    limit: Limit
    period_id: str
    spent: int
    ends_at: float

    def as_dict(self) -> dict[str, Any]:
        """Tokens as integers, dollars as dollars."""
        scale = self.limit.scaled
        return {
            "budget": self.limit.field,
            "period": self.period_id,
            "limit": scale(self.limit.amount),
            "spent": scale(self.spent),
            "remaining": scale(max(self.limit.amount - self.spent, 0)),
            "resets_at": int(self.ends_at),
        }


def show(entry: KeyEntry, spent: list[int]) -> None:
    """Set the key's ``llmgate_key_budget_remaining`` from each budget's spend."""
    assert entry.budget is not None
    for limit, amount in zip(limits_of(entry.budget), spent, strict=True):
        REMAINING.labels(entry.name, limit.field).set(limit.scaled(max(limit.amount - amount, 0)))


def over_budget(entry: KeyEntry, refusal: Refusal, now: float) -> errors.OverBudget:
    """The 429 for a spent budget, worded as OpenAI words a quota used up."""
    limit = refusal.limit
    resets = datetime.fromtimestamp(refusal.ends_at, UTC).strftime("%Y-%m-%d %H:%M UTC")
    if refusal.requested > limit.amount:
        what = f"this request may cost {limit.shown(refusal.requested)}, more than the budget"
    else:
        what = f"Used {limit.shown(refusal.spent)}, Requested {limit.shown(refusal.requested)}"
    return errors.OverBudget(
        f"You exceeded the budget of the API key {entry.name!r} on {limit.field}: "
        f"Limit {limit.shown(limit.amount)}, {what}. It resets at {resets}.",
        max(1, math.ceil(refusal.ends_at - now)),
    )


SpentSoFar = Callable[[KeyEntry, dict[str, Period]], Awaitable[Seeds]]


def from_usage(store: State, price_of: Callable[[str], Price | None]) -> SpentSoFar:
    """What a key spent so far this day and month, by the usage table
    (``gateway.state.usage``: every process's, written every few seconds), at
    ``price_of(model)`` for dollars. Tokens answered from the response cache
    cost no budget; what the table has not been given yet is not counted."""

    async def spent(entry: KeyEntry, now_periods: dict[str, Period]) -> Seeds:
        day = now_periods["day"].id
        first = date.fromisoformat(now_periods["month"].id + "-01")
        rows = await store.call(store.usage.rows, entry.id, None, first, date.fromisoformat(day))
        seeds = {"day": Cost(0, 0), "month": Cost(0, 0)}
        for row in rows:
            prompt, completion = int(row["prompt_tokens"]), int(row["completion_tokens"])
            worked = 1 - int(row["cached_tokens"]) / max(prompt + completion, 1)
            full = cost(prompt, completion, price_of(str(row["model"])))
            row_cost = Cost(round(full.tokens * worked), round(full.micro_usd * worked))
            for name in ("day", "month") if row["day"] == day else ("month",):
                seeds[name] = Cost(
                    seeds[name].tokens + row_cost.tokens,
                    seeds[name].micro_usd + row_cost.micro_usd,
                )
        return seeds

    return spent


def counter(key_id: str, limit: Limit, period_id: str) -> str:
    """A budget's counter in Redis (one hash slot per key, as the rate windows)."""
    return f"llmgate:budget:v1:{{{key_id}}}:{limit.unit}:{period_id}"


class MemoryBudgets:
    """Every key's spend in this process (``--limits`` empty, or Redis away)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        # (key id, unit, period id) -> tokens or micro-dollars
        self._spent: dict[tuple[str, str, str], int] = {}

    def missing(self, entry: KeyEntry, now_periods: dict[str, Period]) -> bool:
        """Whether a budget of the key has no count yet this period (:meth:`seed` it)."""
        assert entry.budget is not None
        return any(
            (entry.id, limit.unit, now_periods[limit.period].id) not in self._spent
            for limit in limits_of(entry.budget)
        )

    def seed(self, entry: KeyEntry, now_periods: dict[str, Period], spent: Seeds) -> None:
        """Start the counts of the key's budgets not counted yet at ``spent``."""
        assert entry.budget is not None
        for limit in limits_of(entry.budget):
            slot = (entry.id, limit.unit, now_periods[limit.period].id)
            self._spent.setdefault(slot, limit.of(spent[limit.period]))

    def reserve(
        self, entry: KeyEntry, want: Cost, now_periods: dict[str, Period]
    ) -> Refusal | Taken:
        """Take ``want`` from every budget of ``entry`` in ``now_periods``, or
        none and say which refuses."""
        assert entry.budget is not None
        for limit in limits_of(entry.budget):
            period = now_periods[limit.period]
            spent = self._spent.get((entry.id, limit.unit, period.id), 0)
            if spent + limit.of(want) > limit.amount:
                return Refusal(limit, spent, limit.of(want), period.ends_at)
        ids = {name: period.id for name, period in now_periods.items()}
        return Taken(ids, self.add(entry, ids, want))

    def add(self, entry: KeyEntry, period_ids: dict[str, str], delta: Cost) -> list[int]:
        """Move the key's spend by ``delta`` (negative: given back) in those
        periods; each budget's spend after."""
        assert entry.budget is not None
        spent = []
        for limit in limits_of(entry.budget):
            slot = (entry.id, limit.unit, period_ids[limit.period])
            spent.append(self._spent.get(slot, 0) + limit.of(delta))
            self._spent[slot] = spent[-1]
        if len(self._spent) > 4096:
            self._forget_past()
        return spent

    def standing(self, entry: KeyEntry) -> list[Standing]:
        if entry.budget is None:
            return []
        now_periods = periods(self.clock())
        out = []
        for limit in limits_of(entry.budget):
            period = now_periods[limit.period]
            spent = self._spent.get((entry.id, limit.unit, period.id), 0)
            out.append(Standing(limit, period.id, spent, period.ends_at))
        return out

    def _forget_past(self) -> None:
        """Drop the counts of days and months before the current ones' predecessors."""
        now_periods = periods(self.clock())
        yesterday = periods(self.clock() - 24 * 3600)
        kept = {p.id for p in (*now_periods.values(), *yesterday.values())}
        self._spent = {slot: n for slot, n in self._spent.items() if slot[2] in kept}


# KEYS: one counter per budget. ARGV: for each, its limit, the amount
# wanted and what to start it at if it is not there (-1: not known yet);
# then the seconds the counters are kept. Returns {0, spend after, ...} when
# taken, {-1} when a counter is not there and its start is not known, else
# {the 1-based index of the budget that refuses, its spend}.
RESERVE = """
local n = #KEYS
local keep = tonumber(ARGV[3 * n + 1])
for i = 1, n do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    local start = tonumber(ARGV[3 * i])
    if start < 0 then return {-1} end
    redis.call('SET', KEYS[i], start, 'EX', keep, 'NX')
  end
end
for i = 1, n do
  local spent = tonumber(redis.call('GET', KEYS[i]) or '0')
  if spent + tonumber(ARGV[3 * i - 1]) > tonumber(ARGV[3 * i - 2]) then
    return {i, spent}
  end
end
local out = {0}
for i = 1, n do
  out[i + 1] = redis.call('INCRBY', KEYS[i], ARGV[3 * i - 1])
  redis.call('EXPIRE', KEYS[i], keep)
end
return out
"""

# KEYS: one counter per budget. ARGV: the delta for each (negative: given
# back). A counter already gone (its period long over) stays gone. Returns
# each spend after.
ADD = """
local out = {}
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    out[i] = redis.call('INCRBY', KEYS[i], ARGV[i])
  else
    out[i] = 0
  end
end
return out
"""


class RedisBudgets:
    """Every key's spend in Redis, shared by every gateway process and replica."""

    def __init__(self, client: Any, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._client = client
        self._reserve = client.register_script(RESERVE)
        self._add = client.register_script(ADD)

    async def reserve(
        self, entry: KeyEntry, want: Cost, now: float, start: Seeds | None = None
    ) -> Refusal | Taken | None:
        """Take ``want`` from every budget of ``entry``, or none and say which
        refuses; None when a budget has no count yet this period and ``start``
        (what the key spent so far in each period) is not given."""
        assert entry.budget is not None
        now_periods = periods(now)
        limits = limits_of(entry.budget)
        keys = [counter(entry.id, lim, now_periods[lim.period].id) for lim in limits]
        args: list[int] = []
        for limit in limits:
            begin = limit.of(start[limit.period]) if start is not None else -1
            args += [limit.amount, limit.of(want), begin]
        refused, *spent = await self._reserve(keys, [*args, _keep(now_periods, now)])
        if int(refused) < 0:
            return None
        if int(refused):
            limit = limits[int(refused) - 1]
            ends_at = now_periods[limit.period].ends_at
            return Refusal(limit, int(spent[0]), limit.of(want), ends_at)
        ids = {name: period.id for name, period in now_periods.items()}
        return Taken(ids, [int(n) for n in spent])

    async def add(self, entry: KeyEntry, period_ids: dict[str, str], delta: Cost) -> list[int]:
        assert entry.budget is not None
        limits = limits_of(entry.budget)
        keys = [counter(entry.id, lim, period_ids[lim.period]) for lim in limits]
        return [int(n) for n in await self._add(keys, [limit.of(delta) for limit in limits])]

    async def standing(self, entry: KeyEntry) -> list[Standing]:
        if entry.budget is None:
            return []
        now_periods = periods(self.clock())
        limits = limits_of(entry.budget)
        keys = [counter(entry.id, lim, now_periods[lim.period].id) for lim in limits]
        values = await self._client.mget(keys) if keys else []
        return [
            Standing(lim, now_periods[lim.period].id, int(v or 0), now_periods[lim.period].ends_at)
            for lim, v in zip(limits, values, strict=True)
        ]


def _keep(now_periods: dict[str, Period], now: float) -> int:
    """Seconds a counter is kept: past the end of the longest period, and then some."""
    ends = max(period.ends_at for period in now_periods.values())
    return math.ceil(ends - now) + KEPT_AFTER
