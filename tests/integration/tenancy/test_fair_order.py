"""Fair sharing across two gateway processes sharing Redis: the order of a gateway's queue
counts the service a key had through the other one. Real Redis, the session's real
worker, gateway ``a`` with one slot on it (``--max-inflight-per-worker 1``).

A request of key ``z`` holds ``a``'s slot; ``y`` queues behind it. While
``y`` waits, key ``x`` is served through gateway ``b``. Then ``x`` queues at
``a``, and ``y`` again. When ``z`` ends, ``y``'s first request runs (it came
first, and the two keys were level when ``y`` became active); when that
ends, ``y``'s second goes before ``x``: ``x`` had more service while ``y``
waited, if elsewhere. With each process counting on its own, ``a`` would
have seen none of it, and served ``x`` first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis.asyncio

from shared import api_keys
from tests.conftest import MODEL, Served, gateway_pair
from tests.harness.redis_server import RedisServer
from tests.integration.test_pool import value_in

NAMES = ("x", "y", "z")
SERVED = "llmgate:fair:v1:{fair}:served"
ACTIVE = "llmgate:fair:v1:{fair}:active"
UNCACHED = {"cache-control": "no-cache, no-store"}


@dataclass
class System:
    a: Served
    b: Served
    keys: dict[str, str]  # name -> secret
    ids: dict[str, str]  # name -> key id (fair sharing's name for it)
    redis_url: str


@pytest.fixture(scope="module")
def system(
    served: Served, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[System]:
    directory = tmp_path_factory.mktemp("fair-order")
    keys_file = directory / "keys.yaml"
    keys = {name: api_keys.add(keys_file, name) for name in NAMES}
    keys["ops"] = api_keys.add(keys_file, "ops", admin=True)
    ids = {entry.name: entry.id for entry in api_keys.load(keys_file)}
    flags = (
        *("--api-keys-file", str(keys_file)),
        *("--limits", redis_server.url),
        # x and y wait for z's long answer; the default 30 s is for users.
        *("--queue-timeout", "600"),
    )

    def each(name: str) -> tuple[str, ...]:
        one_slot = ("--max-inflight-per-worker", "1") if name == "a" else ()
        return ("--state-dir", str(directory / name), *one_slot)

    with gateway_pair(served, directory, *flags, each=each) as (a, b):
        yield System(a, b, keys, ids, redis_server.url)


def _client(gateway: Served, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=gateway.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=600
    )


async def _until(condition: object, what: str) -> None:
    """Until ``await condition()`` holds (a bound guards a hang)."""
    try:
        async with asyncio.timeout(120):
            while not await condition():  # type: ignore[operator]  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within 120 s: {what}") from None


async def test_a_gateways_queue_counts_the_service_a_key_had_through_the_other(
    system: System,
) -> None:
    store = redis.asyncio.Redis.from_url(system.redis_url)
    ended: list[str] = []

    async def ask(http: httpx.AsyncClient, name: str, tokens: int) -> None:
        body = {"model": MODEL, "prompt": f"Story {name}:", "max_tokens": tokens}
        answer = await http.post(
            "/v1/completions", json=body | {"ignore_eos": True}, headers=UNCACHED
        )
        assert answer.status_code == 200, answer.text
        ended.append(name)

    async def queued_at_a(depth: int) -> bool:
        page = await ops.get("/metrics")
        return (value_in(page.text, "llmgate_queue_depth") or 0) >= depth

    async def expiry_of_y() -> int:
        return int(await store.hget(ACTIVE, system.ids["y"]) or 0)

    async with (
        _client(system.b, system.keys["x"]) as x_b,
        _client(system.a, system.keys["x"]) as x_a,
        _client(system.a, system.keys["y"]) as y_a,
        _client(system.a, system.keys["z"]) as z_a,
        _client(system.a, system.keys["ops"]) as ops,
    ):
        # z holds a's one slot; y queues behind it.
        z = asyncio.create_task(ask(z_a, "z", 256))
        await _until(lambda: _in_flight(ops), "z's request on a's slot")
        tasks = [asyncio.create_task(ask(y_a, "y1", 8))]
        await _until(lambda: queued_at_a(1), "y queued at a")
        # x's service through b while y waits, until Redis counts it.
        for n in range(2):
            await ask(x_b, f"x-b{n}", 64)

        async def x_ahead() -> bool:
            x, y = await store.hmget(SERVED, [system.ids["x"], system.ids["y"]])
            return x is not None and y is not None and float(x) >= float(y) + 100

        await _until(x_ahead, "x's service through b in Redis")
        # x, then y again, queue at a.
        tasks.append(asyncio.create_task(ask(x_a, "x", 8)))
        await _until(lambda: queued_at_a(2), "x queued at a")
        told = await expiry_of_y()
        tasks.append(asyncio.create_task(ask(y_a, "y2", 8)))
        await _until(lambda: queued_at_a(3), "y again queued at a")
        # Two exchanges of a's since x queued there (each renews y's activity):
        # a has heard what x had through b.
        for _ in range(2):
            before = told

            async def renewed(before: int = before) -> bool:
                return await expiry_of_y() > before

            await _until(renewed, "an exchange of a's counters")
            told = await expiry_of_y()
        assert not z.done(), "z ended before the queue was set up: give it more tokens"
        await asyncio.gather(z, *tasks)
    await store.aclose()
    assert ended[2:] == ["z", "y1", "y2", "x"], ended


async def _in_flight(ops: httpx.AsyncClient) -> bool:
    page = await ops.get("/metrics")
    return (value_in(page.text, "llmgate_requests_in_flight") or 0) >= 1
