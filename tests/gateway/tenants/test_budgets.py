"""Key budgets: reserved before a request, settled to the engine's count, by UTC day and month.

Each case runs on both stores (this process's memory, and a real Redis),
with a controllable calendar clock.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import pytest_asyncio

from gateway import errors
from gateway.context import RequestContext
from gateway.dispatch.models import Models, Target, Tier
from gateway.tenants import budgets
from gateway.tenants import limits as limits_module
from gateway.tenants.limits import Limiter, settle
from shared import config, protocol
from shared.api_keys import Budget, KeyEntry
from shared.config import Price
from tests.harness.redis_server import RedisServer

PATIENT = 30.0  # seconds a test waits for Redis (the machine may be busy)


class Calendar:
    """A wall clock the test moves."""

    def __init__(self, when: str) -> None:
        self.now = datetime.fromisoformat(when).replace(tzinfo=UTC).timestamp()

    def __call__(self) -> float:
        return self.now

    def move_to(self, when: str) -> None:
        self.now = datetime.fromisoformat(when).replace(tzinfo=UTC).timestamp()


@pytest.fixture
def calendar() -> Calendar:
    return Calendar("2026-12-31T23:00:00")


@pytest_asyncio.fixture(params=["memory", "redis"], loop_scope="function")
async def limiter(
    request: pytest.FixtureRequest, redis_server: RedisServer, calendar: Calendar
) -> AsyncIterator[Limiter]:
    url = redis_server.url if request.param == "redis" else ""
    limiter = Limiter(url, timeout=PATIENT, wall_clock=calendar)
    await limiter.start()
    try:
        yield limiter
    finally:
        await limiter.stop()


def key(**budget: float) -> KeyEntry:
    """A key with ``budget``, and an id no other test uses (Redis outlives tests)."""
    digest = uuid.uuid4().hex * 2
    return KeyEntry(name=f"team-{digest[:8]}", key_sha256=digest, budget=Budget(**budget))


async def take(
    limiter: Limiter, entry: KeyEntry, prompt: int, completion: int, price: Price | None = None
) -> RequestContext:
    context = RequestContext(key=entry)
    await limiter.admit(context, entry, lambda: (prompt, completion), price)
    return context


async def spent(limiter: Limiter, entry: KeyEntry) -> dict[str, float]:
    await limiter.drain()
    return {s.limit.field: s.as_dict()["spent"] for s in await limiter.spending.standing(entry)}


def finish(context: RequestContext, prompt: int, completion: int, status: int = 200) -> None:
    settle(context, protocol.Usage(prompt_tokens=prompt, completion_tokens=completion))
    assert context.grant is not None
    context.grant.end(status)


def test_the_periods_are_the_utc_day_and_calendar_month() -> None:
    now = datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()
    day, month = budgets.periods(now)["day"], budgets.periods(now)["month"]
    assert (day.id, month.id) == ("2026-12-31", "2026-12")
    new_year = datetime(2027, 1, 1, tzinfo=UTC).timestamp()
    assert day.ends_at == month.ends_at == new_year
    assert budgets.periods(new_year)["month"].id == "2027-01"


def test_dollars_are_counted_in_micro_dollars_at_the_price() -> None:
    # $0.15 in and $0.60 out per million tokens: micro-dollars per token.
    assert budgets.cost(1000, 500, Price(input=0.15, output=0.60)) == budgets.Cost(1500, 450)
    assert budgets.cost(1, 0, Price(input=0.15, output=0.60)).micro_usd == 1  # rounded up
    assert budgets.cost(10, 5, None) == budgets.Cost(15, 0)


async def test_a_reservation_past_the_budget_is_refused_until_it_resets(
    limiter: Limiter, calendar: Calendar
) -> None:
    entry = key(tokens_per_day=100)
    first = await take(limiter, entry, 30, 30)
    with pytest.raises(errors.OverBudget) as caught:
        await take(limiter, entry, 30, 30)
    refusal = caught.value
    assert (refusal.status, refusal.code) == (429, "insufficient_quota")
    assert refusal.body()["error"]["type"] == "insufficient_quota"
    # It resets at the next UTC midnight, an hour away.
    assert refusal.headers() == {"Retry-After": "3600"}
    assert "tokens_per_day" in refusal.message and "2027-01-01 00:00 UTC" in refusal.message
    # Settled to what the engine computed, the room comes back.
    finish(first, 30, 5)
    assert await spent(limiter, entry) == {"tokens_per_day": 35}
    finish(await take(limiter, entry, 30, 30), 30, 30)
    assert await spent(limiter, entry) == {"tokens_per_day": 95}
    calendar.move_to("2027-01-01T00:00:01")
    assert await spent(limiter, entry) == {"tokens_per_day": 0}
    finish(await take(limiter, entry, 50, 50), 50, 50)


async def test_a_month_boundary_resets_the_month_not_a_request_in_flight(
    limiter: Limiter, calendar: Calendar
) -> None:
    entry = key(tokens_per_month=1000, usd_per_day=1.0)
    price = Price(input=100.0, output=1000.0)  # $0.0001 and $0.001 a token
    running = await take(limiter, entry, 100, 100, price)  # 200 tokens, $0.11
    assert await spent(limiter, entry) == {"tokens_per_month": 200, "usd_per_day": 0.11}
    calendar.move_to("2027-01-01T00:00:01")
    assert await spent(limiter, entry) == {"tokens_per_month": 0, "usd_per_day": 0.0}
    # A request reserved in December settles in December: January stays clean.
    finish(running, 100, 10)
    assert await spent(limiter, entry) == {"tokens_per_month": 0, "usd_per_day": 0.0}


async def test_a_dollar_budget_refuses_by_price(limiter: Limiter) -> None:
    entry = key(usd_per_day=0.01)
    price = Price(input=1000.0, output=2000.0)  # $0.001, $0.002 a token
    finish(await take(limiter, entry, 2, 2, price), 2, 2)  # $0.006
    with pytest.raises(errors.OverBudget, match=r"usd_per_day: Limit \$0\.01"):
        await take(limiter, entry, 1, 2, price)  # $0.005 more: past $0.01
    assert await spent(limiter, entry) == {"usd_per_day": 0.006}


async def test_a_request_a_rate_limit_refuses_gives_its_reservation_back(
    limiter: Limiter,
) -> None:
    digest = uuid.uuid4().hex * 2
    entry = KeyEntry(
        name=f"team-{digest[:8]}",
        key_sha256=digest,
        requests_per_minute=1,
        budget=Budget(tokens_per_day=1000),
    )
    finish(await take(limiter, entry, 10, 10), 10, 10)
    with pytest.raises(errors.RateLimited) as caught:
        await take(limiter, entry, 10, 10)
    assert not isinstance(caught.value, errors.OverBudget)
    assert await spent(limiter, entry) == {"tokens_per_day": 20}


async def test_an_error_costs_nothing_and_a_client_that_left_pays_its_reservation(
    limiter: Limiter,
) -> None:
    entry = key(tokens_per_day=1000)
    refused = await take(limiter, entry, 10, 90)
    assert refused.grant is not None
    refused.grant.end(400)
    assert await spent(limiter, entry) == {"tokens_per_day": 0}
    left = await take(limiter, entry, 10, 90)
    assert left.grant is not None
    left.grant.end(499)
    assert await spent(limiter, entry) == {"tokens_per_day": 100}


async def test_concurrent_reservations_over_two_gateways_never_pass_the_budget(
    redis_server: RedisServer, calendar: Calendar
) -> None:
    """Two gateways' limiters on one Redis, 64 requests at once: the budget
    admits what fits and no more, and spend ends at what the engine counted."""
    gateways = [Limiter(redis_server.url, timeout=PATIENT, wall_clock=calendar) for _ in "ab"]
    entry = key(tokens_per_day=1000)

    async def one(limiter: Limiter) -> int:
        try:
            context = await take(limiter, entry, 20, 80)  # reserves 100
        except errors.OverBudget:
            return 0
        await asyncio.sleep(0)
        finish(context, 20, 30)  # the engine computed 50
        return 50

    try:
        counted = await asyncio.gather(*(one(gateways[i % 2]) for i in range(64)))
        for limiter in gateways:
            await limiter.drain()
        total = sum(counted)
        assert total > 0
        assert await spent(gateways[0], entry) == {"tokens_per_day": total}
        assert total <= 1000
    finally:
        for limiter in gateways:
            await limiter.stop()


async def test_a_dollar_budget_takes_no_model_without_a_price() -> None:
    pools = config.parse(
        "pools:\n"
        "  - {name: cheap, price: {input: 0.1, output: 0.2}}\n"
        "  - {name: free}\n"
        "  - {name: dear, tier: 2, substitute_for: [cheap], price: {input: 1, output: 3}}\n"
    )
    models = Models(pools)
    cheap = models.resolve("cheap", {}, [])
    # Spill-over may run it on the dearer pool: counted at the dearest price.
    assert models.price(cheap) == Price(input=1.0, output=3.0)
    assert models.price(models.resolve("free", {}, [])) is None
    assert models.price(Target("lora", (Tier("", "lora"),))) is None

    class Pool:
        names = models

        def healthy_workers(self) -> list[object]:
            return []

    entry = key(usd_per_month=5.0)
    context = RequestContext(key=entry)
    free = models.resolve("free", {}, [])
    with pytest.raises(errors.Forbidden, match="has no price"):
        await limits_module.admit(Limiter(), context, Pool(), free, {"prompt": "hi"}, 1)
    limiter = Limiter()
    await limits_module.admit(limiter, context, Pool(), cheap, {"prompt": "hi", "max_tokens": 4}, 1)
    assert context.grant is not None and context.grant.hold is not None  # type: ignore[attr-defined]
    assert context.grant.hold.price == Price(input=1.0, output=3.0)  # type: ignore[attr-defined]


def test_budgets_in_the_keys_file(tmp_path: object) -> None:
    from shared import api_keys

    text = (
        "keys:\n"
        "  - {name: a, key: sk-a, budget: {tokens_per_day: 10, usd_per_month: 2.5}}\n"
        "  - {name: b, key: sk-b, budget: {}}\n"
    )
    a, b = api_keys.parse(text, "keys.yaml")
    assert a.budget == Budget(tokens_per_day=10, usd_per_month=2.5) and b.budget is None
    with pytest.raises(ValueError, match=r"budget.usd_per_day` must be 0"):
        api_keys.parse("keys:\n  - {name: a, key: sk-a, budget: {usd_per_day: -1}}\n", "k")
    with pytest.raises(ValueError, match="budget"):
        api_keys.parse("keys:\n  - {name: a, key: sk-a, budget: {per_year: 1}}\n", "k")


def test_a_budgets_prompt_bound_is_never_below_the_tokens() -> None:
    from gateway.tenants.costs import MESSAGE_TOKENS, TEMPLATE_TOKENS, prompt_bound

    # A token a byte at most: "é" is two bytes; token ids count as given.
    assert prompt_bound({"prompt": "café"}) == 5
    assert prompt_bound({"prompt": [[1, 2, 3]]}) == 3
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "yo"}]}
    assert prompt_bound(chat) == 4 + TEMPLATE_TOKENS + 2 * MESSAGE_TOKENS


async def test_a_budget_with_no_count_yet_starts_at_what_the_key_spent(
    limiter: Limiter, calendar: Calendar
) -> None:
    """A gateway that just started, or a Redis that lost its data, must not
    give a key its month again: the count starts at the key's usage so far."""
    entry = key(tokens_per_day=1000, tokens_per_month=1000)
    asked: list[dict[str, str]] = []

    async def spent_so_far(entry: KeyEntry, periods: dict[str, budgets.Period]) -> budgets.Seeds:
        asked.append({name: period.id for name, period in periods.items()})
        return {"day": budgets.Cost(60, 0), "month": budgets.Cost(950, 0)}

    limiter.spending.spent_so_far = spent_so_far
    finish(await take(limiter, entry, 10, 10), 10, 10)
    assert await spent(limiter, entry) == {"tokens_per_day": 80, "tokens_per_month": 970}
    with pytest.raises(errors.OverBudget, match="tokens_per_month"):
        await take(limiter, entry, 20, 20)
    assert asked == [{"day": "2026-12-31", "month": "2026-12"}]  # once a period
    if limiter.redis is not None:  # Redis restarted without its data: asked again
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(limiter.redis.url)
        for name in await client.keys(f"llmgate:budget:v1:{{{entry.id}}}:*"):
            await client.delete(name)
        await client.aclose()
        with pytest.raises(
            errors.OverBudget, match="tokens_per_month: Limit 1,000 tokens, Used 950"
        ):
            await take(limiter, entry, 30, 30)
        assert len(asked) == 2


async def test_what_a_key_spent_so_far_is_read_from_the_usage_table(tmp_path: Path) -> None:
    from gateway.state import State
    from gateway.state.usage import Counts
    from shared.settings import StoreSettings

    store = State(StoreSettings(state_dir=str(tmp_path)))
    await asyncio.wait_for(store.connect(), PATIENT)
    try:
        rows = {
            ("key_a", "m", "2026-12-31"): Counts(2, 1000, 500, 0),
            ("key_a", "m", "2026-12-01"): Counts(1, 100, 100, 0),
            # A response-cache hit's tokens cost the budget nothing.
            ("key_a", "cached", "2026-12-31"): Counts(1, 10, 10, 20),
            ("key_a", "m", "2026-11-30"): Counts(1, 999, 999, 0),
            ("key_b", "m", "2026-12-31"): Counts(1, 999, 999, 0),
        }
        store.usage.add("flush-1", rows)
        prices = {"m": Price(input=1.0, output=2.0)}
        spent_so_far = budgets.from_usage(store, prices.get)
        entry = KeyEntry(name="a", key_sha256="0" * 64, id="key_a")
        now = datetime(2026, 12, 31, 12, tzinfo=UTC).timestamp()
        seeds = await spent_so_far(entry, budgets.periods(now))
        assert seeds == {
            "day": budgets.Cost(1500, 2000),
            "month": budgets.Cost(1700, 2300),
        }
    finally:
        store.db.close()
