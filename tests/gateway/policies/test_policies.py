"""Routing policies: least-load, prefix affinity with bounded load, round-robin."""

from __future__ import annotations

import collections
import random
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.dispatch.policies import Hinted, RoutingContext, load, make_policy
from gateway.dispatch.policies.least_load import LeastLoad
from gateway.dispatch.policies.prefix import PrefixAffinity
from gateway.dispatch.policies.round_robin import RoundRobin
from gateway.dispatch.work import WorkOrder
from gateway.dispatch.workers import Worker


def workers(n: int) -> list[Worker]:
    return [
        Worker(link=SimpleNamespace(address=f"tcp://10.0.0.{i}:5550"))  # type: ignore[arg-type]
        for i in range(n)
    ]


def ctx(candidates: list[Worker], key: str | None = None) -> RoutingContext:
    return RoutingContext(candidates, key)


def test_load_is_own_in_flight_plus_other_gateways_requests() -> None:
    (worker,) = workers(1)
    worker.in_flight, worker.others = 3, 2
    assert load(worker) == 5


def test_least_load_takes_the_lighter_of_two() -> None:
    pool = workers(2)
    pool[0].in_flight = 10
    policy = LeastLoad(random.Random(0))
    assert all(policy.select(ctx(pool)) is pool[1] for _ in range(20))


def test_least_load_spreads_equal_workers() -> None:
    pool = workers(4)
    policy = LeastLoad(random.Random(1))
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(400):
        chosen = policy.select(ctx(pool))
        chosen.in_flight += 1
        counts[chosen.key] += 1
    # Power of two choices keeps them within a request or two of each other.
    assert max(counts.values()) - min(counts.values()) <= 2


def test_least_load_with_one_candidate() -> None:
    (only,) = workers(1)
    assert LeastLoad().select(ctx([only])) is only


def test_round_robin_goes_in_turn() -> None:
    pool = workers(3)
    policy = RoundRobin()
    assert [policy.select(ctx(pool)).key for _ in range(6)] == [w.key for w in pool] * 2


def test_prefix_sends_a_key_to_the_same_worker() -> None:
    pool = workers(4)
    policy = PrefixAffinity()
    chosen = {policy.select(ctx(pool, "You are a helpful assistant. Q1")).key for _ in range(10)}
    assert len(chosen) == 1


def test_prefix_spreads_different_keys() -> None:
    pool = workers(4)
    policy = PrefixAffinity()
    chosen = collections.Counter(policy.select(ctx(pool, f"key-{i}")).key for i in range(400))
    assert len(chosen) == 4 and min(chosen.values()) > 50


def test_prefix_keeps_a_hot_key_within_the_load_bound() -> None:
    pool = workers(2)
    policy = PrefixAffinity(load_factor=1.25)
    for _ in range(40):
        context = ctx(pool, "hot prefix")
        bound = policy.bound(context)
        chosen = policy.select(context)
        chosen.in_flight += 1
        assert chosen.in_flight <= bound
    # The hot key's home worker holds at most 1.25x the mean: 25 of 40.
    assert max(w.in_flight for w in pool) <= 25
    assert min(w.in_flight for w in pool) >= 15


def test_removing_a_worker_moves_only_its_keys() -> None:
    pool = workers(4)
    policy = PrefixAffinity()
    keys = [f"session-{i}" for i in range(200)]
    before = {k: policy.select(ctx(pool, k)).key for k in keys}
    gone = pool[2]
    after = {k: policy.select(ctx([w for w in pool if w is not gone], k)).key for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone.key for k in moved)


def test_prefix_without_a_key_falls_back_to_least_load() -> None:
    pool = workers(2)
    pool[0].in_flight = 5
    assert PrefixAffinity().select(ctx(pool)) is pool[1]


@pytest.mark.parametrize("name, cls", [("least-load", LeastLoad), ("round-robin", RoundRobin)])
def test_keyless_policies_by_name_honour_hints(name: str, cls: Any) -> None:
    policy = make_policy(name, 1.25, 4)
    assert isinstance(policy, Hinted)
    assert isinstance(policy.policy, cls) and isinstance(policy.affinity, PrefixAffinity)


def test_the_prefix_policy_by_name() -> None:
    assert isinstance(make_policy("prefix", 1.25, 4), PrefixAffinity)


@pytest.mark.parametrize("name", ["least-load", "round-robin"])
def test_a_hinted_request_keeps_to_its_worker_under_keyless_policies(name: str) -> None:
    pool = workers(4)
    policy = make_policy(name, 1.25, 4)
    hinted = WorkOrder("r", "chat", "m", {}, key="session-7", hinted=True)
    first = policy.select(RoutingContext(pool, "session-7", "m", hinted))
    first.in_flight += 1  # still within the bound: it stays
    assert all(
        policy.select(RoutingContext(pool, "session-7", "m", hinted)) is first for _ in range(8)
    )
    # Unhinted requests are the policy's own: they spread.
    plain = WorkOrder("s", "chat", "m", {})
    assert len({policy.select(RoutingContext(pool, None, "m", plain)).key for _ in range(40)}) > 1


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="least-load"):
        make_policy("random-ish", 1.25, 4)


async def test_a_heartbeat_counts_only_other_gateways_requests() -> None:
    # Regression: load used to add the reported waiting count to in_flight,
    # counting this gateway's queued requests twice (and a second late).
    from gateway.dispatch.pool import Pool
    from shared import protocol

    pool = Pool()
    (worker,) = workers(1)
    pool.workers.by_address[worker.address] = worker
    worker.in_flight = 6
    beat = protocol.Heartbeat("w", "i", ["m"], running=4, waiting=5, capacity=8)
    pool.workers.on_heartbeat(worker, beat)
    assert worker.others == 3  # 9 on the worker, 6 of them ours
    worker.in_flight = 12  # ours grew since: never negative
    pool.workers.on_heartbeat(worker, beat)
    assert worker.others == 0
    assert load(worker) == 12


def chat(*turns: tuple[str, str]) -> list[Any]:
    from gateway.dialects.schemas import ChatMessage

    return [ChatMessage(role=role, content=text) for role, text in turns]  # type: ignore[arg-type]


def test_a_conversations_key_is_the_same_at_every_turn() -> None:
    from gateway.api.openai_routes import _messages_key

    system = ("system", "You are a helpful assistant. " * 40)  # longer than the limit
    first = chat(system, ("user", "Tell me about owls."))
    later = chat(
        system,
        ("user", "Tell me about owls."),
        ("assistant", "Owls are birds."),
        ("user", "And their eyes?"),
    )
    assert _messages_key(first, 256) == _messages_key(later, 256)


def test_conversations_sharing_a_long_system_prompt_get_different_keys() -> None:
    from gateway.api.openai_routes import _messages_key

    system = ("system", "You are a helpful assistant. " * 40)
    owls = _messages_key(chat(system, ("user", "Tell me about owls.")), 256)
    cats = _messages_key(chat(system, ("user", "Tell me about cats.")), 256)
    assert owls != cats
    # Each message counts up to the limit: the system prompt's tail does not.
    other_tail = ("system", "You are a helpful assistant. " * 40 + "Be brief.")
    assert owls == _messages_key(chat(other_tail, ("user", "Tell me about owls.")), 256)


def test_content_parts_make_the_same_key_as_text() -> None:
    from gateway.api.openai_routes import _messages_key
    from gateway.dialects.schemas import ChatMessage

    parts = [ChatMessage(role="user", content=[{"type": "text", "text": "Hi there"}])]
    assert _messages_key(parts, 256) == _messages_key(chat(("user", "Hi there")), 256)


def test_prefix_places_a_few_new_conversations_evenly() -> None:
    """Pure hashing put 3 of 4 conversations on one of 2 workers in the
    multi-turn bench; placement on the least loaded worker does not."""
    for trial in range(20):
        pool = workers(2)
        policy = PrefixAffinity()
        for i in range(4):
            policy.select(ctx(pool, f"trial {trial} conversation {i}")).in_flight += 1
        assert sorted(w.in_flight for w in pool) == [2, 2]


def test_prefix_keeps_a_conversation_on_its_worker_while_within_the_bound() -> None:
    pool = workers(2)
    policy = PrefixAffinity(load_factor=1.5, slack=0)  # the factor alone
    home = policy.select(ctx(pool, "conversation"))
    home.in_flight += 1  # the other worker is now less loaded...
    assert policy.select(ctx(pool, "conversation")) is home  # ...but the history is here


def test_prefix_remembers_a_bounded_number_of_keys() -> None:
    pool = workers(2)
    policy = PrefixAffinity(remembered=3)
    for i in range(10):
        policy.select(ctx(pool, f"key-{i}"))
    assert list(policy._placed) == ["key-7", "key-8", "key-9"]


def test_prefix_keeps_a_conversation_home_at_small_loads_within_the_slack() -> None:
    """With two requests on the home worker and none on the other, 1.25x the
    mean alone (a bound of 2) moved the third turn away, and the other worker
    recomputed its whole history; the slack keeps it home."""
    pool = workers(2)
    policy = PrefixAffinity(load_factor=1.25, slack=4)
    home = policy.select(ctx(pool, "conversation"))
    home.in_flight = 2
    assert policy.bound(ctx(pool, "conversation")) == 6  # ceil(1.5) + 4
    assert policy.select(ctx(pool, "conversation")) is home
    # Without the slack, the old hair trigger: the bound is 2, so it moves.
    hair_trigger = PrefixAffinity(load_factor=1.25, slack=0)
    assert hair_trigger.bound(ctx(pool)) == 2
    hair_trigger._placed["conversation"] = home.key
    assert hair_trigger.select(ctx(pool, "conversation")) is not home


def test_prefix_moves_a_conversation_past_both_bounds() -> None:
    pool = workers(2)
    policy = PrefixAffinity(load_factor=1.25, slack=4)
    home = policy.select(ctx(pool, "conversation"))
    other = next(w for w in pool if w is not home)
    # Bound: max(ceil(1.25 * mean), ceil(mean) + 4), the mean counting the new request.
    home.in_flight = 7  # mean 4: bound max(5, 8) = 8, and 7 + 1 fits
    assert policy.select(ctx(pool, "conversation")) is home
    home.in_flight = 8  # mean 4.5: bound max(6, 9) = 9, and 8 + 1 fits
    assert policy.select(ctx(pool, "conversation")) is home
    home.in_flight = 9  # mean 5: bound max(7, 9) = 9, and 9 + 1 does not fit
    assert policy.select(ctx(pool, "conversation")) is other
    # ...and it stays where it went (that worker now holds its history).
    other.in_flight = 1
    assert policy.select(ctx(pool, "conversation")) is other


def test_the_prefix_slack_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="slack"):
        PrefixAffinity(slack=-1)
