"""gateway/dispatch/admission.py with pools and tiers: spill-over to a later tier, not elsewhere."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway import errors, metrics
from gateway.dispatch.models import Models, Tier
from gateway.dispatch.pool import Pool
from gateway.dispatch.work import WorkOrder
from gateway.dispatch.workers import Worker
from shared import config, protocol
from shared.settings import AdmissionSettings, LinkSettings

CONFIG = """\
pools:
  - {name: home, served_model_name: m, spill_after: %s}
  - {name: spare, served_model_name: m2, tier: 2, substitute_for: [m]}
  - {name: other, served_model_name: m3, tier: 2}
"""


class Link(SimpleNamespace):
    def send(self, message: Any) -> None:
        self.sent.append(message)


def worker(pool: Pool, name: str, model: str, capacity: int, in_pool: str | None = None) -> Worker:
    state = Worker(link=Link(address=f"tcp://{name}:5550", sent=[]))  # type: ignore[arg-type]
    pool.workers.by_address[state.address] = state
    beat = protocol.Heartbeat(name, "i", [model], capacity=capacity, pool=in_pool or name)
    pool.workers.on_heartbeat(state, beat)
    return state


async def make_pool(spill_after: str) -> Pool:
    models = Models(config.parse(CONFIG % spill_after))
    pool = Pool(admission=AdmissionSettings(queue_timeout=30), models=models)
    worker(pool, "home", "m", capacity=1)
    worker(pool, "spare", "m2", capacity=1)
    worker(pool, "other", "m3", capacity=4)
    return pool


def spilled() -> float:
    return metrics.child(metrics.SPILLOVER, "home", "spare")._value.get()  # type: ignore[attr-defined]


async def submit(pool: Pool, rid: str) -> Any:
    return await pool.submit(WorkOrder(rid, "completion", pool.resolve("m", {}, []), {}, 0.0))


async def test_a_full_home_pool_spills_at_once_with_spill_after_zero() -> None:
    pool = await make_pool("0")
    before = spilled()
    first = await submit(pool, "a")
    second = await submit(pool, "b")
    assert first.answered_by.pool == "home" and first.answered_by.model == "m"
    # Sent to the substitute under the substitute's own served name.
    assert second.answered_by.pool == "spare" and second.answered_by.model == "m2"
    assert pool.workers.by_address[second.answered_by.address].link.sent[-1].model == "m2"
    assert spilled() == before + 1
    # Both full: the third waits, and takes whichever slot frees first.
    third = asyncio.create_task(submit(pool, "c"))
    await asyncio.sleep(0)
    assert not third.done() and pool.admission.pool(Tier("home", "m")).queued == 1
    second.close()
    assert (await third).answered_by.pool == "spare"
    first.close()
    pool.workers.ctx.term()


async def test_without_spill_after_a_request_waits_for_its_home_pool() -> None:
    pool = await make_pool("null")
    first = await submit(pool, "a")
    waiting = asyncio.create_task(submit(pool, "b"))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the spare's free slot is not for it
    first.close()
    assert (await waiting).answered_by.pool == "home"
    pool.workers.ctx.term()


async def test_spill_after_lets_a_request_wait_that_long_first() -> None:
    pool = await make_pool("0.2")
    first = await submit(pool, "a")
    # Its expected wait is unknown (no request has finished): it queues,
    # then takes the spare's slot once it has waited 0.2 s.
    second = await submit(pool, "b")
    assert second.answered_by.pool == "spare"
    first.close()
    second.close()
    pool.workers.ctx.term()


async def test_a_queued_request_keeps_its_place_over_a_newcomer() -> None:
    pool = await make_pool("null")
    first = await submit(pool, "a")
    queued = asyncio.create_task(submit(pool, "b"))
    await asyncio.sleep(0)
    first.close()
    newcomer = asyncio.create_task(submit(pool, "c"))
    assert (await queued).answered_by.pool == "home"
    await asyncio.sleep(0.05)
    assert not newcomer.done()
    newcomer.cancel()
    pool.workers.ctx.term()


async def test_no_pool_the_config_does_not_declare_as_substitute_takes_a_request() -> None:
    pool = await make_pool("0")
    # `other` has free slots but is no substitute for m; the spare is busy.
    spare_user = await pool.submit(
        WorkOrder("s", "completion", pool.resolve("m2", {}, []), {}, 0.0)
    )
    first = await submit(pool, "a")
    waiting = asyncio.create_task(submit(pool, "b"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    spare_user.close()
    assert (await waiting).answered_by.pool == "spare"
    first.close()
    pool.workers.ctx.term()


async def test_an_unknown_model_is_a_404_even_with_pools() -> None:
    pool = await make_pool("0")
    with pytest.raises(errors.ModelNotFound):
        await pool.submit(WorkOrder("x", "completion", pool.resolve("nope", {}, []), {}, 0.0))
    pool.workers.ctx.term()


STARTING = """\
pools:
  - {name: up, served_model_name: m}
  - {name: starting, served_model_name: later}
aliases:
  soon: later
auto:
  rules:
    - {headers: {x-tier: up}, use: m}
  default: soon
"""


def starting_pool() -> Pool:
    """Pool `up` has its worker; pool `starting` has none yet."""
    pool = Pool(models=Models(config.parse(STARTING)))
    worker(pool, "up", "m", capacity=4)
    return pool


async def test_a_declared_model_whose_pool_is_starting_is_a_503_not_a_404() -> None:
    """Regression: the alias of a pool still starting answered 404 "does not exist"."""
    pool = starting_pool()
    for name in ("later", "soon", "auto"):
        with pytest.raises(errors.ModelNotReady) as refused:
            await pool.submit(WorkOrder("x", "completion", pool.resolve(name, {}, []), {}, 0.0))
        assert refused.value.status == 503 and refused.value.param == "model"
        assert refused.value.headers() == {"Retry-After": str(errors.NO_WORKER_RETRY_AFTER)}
        assert "`later` is not ready: it is starting" in refused.value.message
    # auto's rule for the pool that is up runs; a name nobody declared is a 404.
    target = pool.resolve("auto", {}, [(b"x-tier", b"up")])
    handle = await pool.submit(WorkOrder("y", "completion", target, {}, 0.0))
    assert handle.answered_by.pool == "up"
    handle.close()
    with pytest.raises(errors.ModelNotFound):
        await pool.submit(WorkOrder("z", "completion", pool.resolve("nope", {}, []), {}, 0.0))
    pool.workers.ctx.term()


async def test_a_declared_model_is_served_once_its_worker_comes_up() -> None:
    pool = starting_pool()
    worker(pool, "starting", "later", capacity=1)
    handle = await pool.submit(WorkOrder("x", "completion", pool.resolve("soon", {}, []), {}, 0.0))
    assert handle.answered_by.pool == "starting" and handle.answered_by.model == "later"
    handle.close()
    pool.workers.ctx.term()


async def test_a_declared_model_whose_workers_died_is_a_503_that_says_so() -> None:
    pool = starting_pool()
    later = worker(pool, "starting", "later", capacity=1)
    pool.workers.lose(later, "its connection dropped")
    with pytest.raises(errors.ModelNotReady) as refused:
        await pool.submit(WorkOrder("x", "completion", pool.resolve("soon", {}, []), {}, 0.0))
    assert "no worker serves it now" in refused.value.message
    pool.workers.ctx.term()


async def test_without_a_config_a_model_once_served_is_a_503_and_a_new_name_a_404() -> None:
    pool = Pool(models=Models())
    worker(pool, "a", "m", capacity=1)
    gone = worker(pool, "b", "m2", capacity=1)
    pool.workers.lose(gone, "its connection dropped")
    with pytest.raises(errors.ModelNotReady):
        await pool.submit(WorkOrder("x", "completion", "m2", {}, 0.0))
    with pytest.raises(errors.ModelNotFound):
        await pool.submit(WorkOrder("y", "completion", "m3", {}, 0.0))
    pool.workers.ctx.term()


async def test_with_no_worker_up_at_all_a_request_gets_a_503_with_retry_after() -> None:
    pool = Pool(LinkSettings(startup_timeout=0.01), models=Models(config.parse(STARTING)))
    # A declared name says it is starting; any other name cannot be judged yet.
    with pytest.raises(errors.ModelNotReady) as declared:
        await pool.submit(WorkOrder("x", "completion", pool.resolve("soon", {}, []), {}, 0.0))
    with pytest.raises(errors.NoWorker) as undeclared:
        await pool.submit(WorkOrder("y", "completion", pool.resolve("nope", {}, []), {}, 0.0))
    assert type(undeclared.value) is errors.NoWorker
    for refused in (declared, undeclared):
        assert refused.value.headers() == {"Retry-After": str(errors.NO_WORKER_RETRY_AFTER)}
    pool.workers.ctx.term()


async def test_requests_queued_for_a_pool_start_when_its_worker_comes_up() -> None:
    pool = await make_pool("null")
    home = pool.workers.by_address["tcp://home:5550"]
    first = await submit(pool, "a")
    queued = [asyncio.create_task(submit(pool, r)) for r in ("b", "c")]
    await asyncio.sleep(0)
    # A second worker of the home pool comes up with room for one: the first
    # in line gets it, the other keeps waiting.
    late = worker(pool, "home2", "m", capacity=1, in_pool="home")
    assert (await queued[0]).answered_by.address == late.address
    await asyncio.sleep(0.05)
    assert not queued[1].done()
    first.close()
    assert (await queued[1]).answered_by.address == home.address
    pool.workers.ctx.term()


async def test_a_gateway_places_workers_by_the_addresses_its_config_lists() -> None:
    """llmgate gateway --config with `addresses:`: workers that do not name a pool."""
    text = """\
pools:
  - {name: gpu, served_model_name: m, addresses: ["10.0.0.1:5550"]}
  - {name: cpu, served_model_name: m, tier: 2, addresses: ["tcp://10.0.0.2:5550"]}
"""
    pool = Pool(models=Models(config.parse(text)))
    # The config's addresses are the workers (--workers left at its default).
    assert pool.discovery.specs == ["tcp://10.0.0.1:5550", "tcp://10.0.0.2:5550"]
    for address in ("tcp://10.0.0.1:5550", "tcp://10.0.0.2:5550"):
        state = Worker(link=Link(address=address, sent=[]))  # type: ignore[arg-type]
        pool.workers.by_address[address] = state
        pool.workers.on_heartbeat(state, protocol.Heartbeat("w", "i", ["m"], capacity=1))
    handle = await submit(pool, "a")
    assert (handle.answered_by.address, handle.answered_by.pool) == ("tcp://10.0.0.1:5550", "gpu")
    assert pool.workers.by_address["tcp://10.0.0.2:5550"].pool == "cpu"
    handle.close()
    pool.workers.ctx.term()
