"""gateway/dispatch/handle.py: a request's items in order, its deadline, who answered, close."""

from __future__ import annotations

import asyncio

import pytest

from gateway import errors
from gateway.dispatch.handle import Answerer, Delivery, RequestHandle, WorkerLost
from gateway.dispatch.models import Models
from gateway.dispatch.pool import Pool
from gateway.dispatch.work import WorkOrder
from shared import config, protocol
from tests.gateway.test_tiers import worker

WHO = Answerer("tcp://a:5550", "run-1", "m", "home", "fp", chat_parser=False)


def delta(text: str, usage: bool = False) -> protocol.Delta:
    return protocol.Delta("r", 0, text, 1, usage=protocol.Usage(1, 1) if usage else None)


def opened() -> tuple[RequestHandle, Delivery, list[str]]:
    released: list[str] = []
    handle, delivery = RequestHandle.open("r", WHO, lambda: released.append("r"))
    return handle, delivery, released


async def test_async_for_yields_the_items_in_order_and_ends_with_the_last_one() -> None:
    handle, delivery, _ = opened()
    for item in (delta("a"), delta("b"), delta("", usage=True), delta("late")):
        delivery.deliver(item)
    texts = [item.text async for item in handle if isinstance(item, protocol.Delta)]
    assert texts == ["a", "b", ""]  # the delta with usage is the last one read
    handle.close()


@pytest.mark.parametrize(
    "last", [protocol.Failed("r", 503, "draining"), WorkerLost("its connection dropped")]
)
async def test_a_failure_is_the_last_item(last: protocol.Failed | WorkerLost) -> None:
    handle, delivery, _ = opened()
    delivery.deliver(delta("a"))
    delivery.deliver(last)
    assert [item async for item in handle] == [delta("a"), last]
    handle.close()


async def test_finished_is_known_when_the_last_item_arrives_not_when_it_is_read() -> None:
    handle, delivery, _ = opened()
    delivery.deliver(delta("a"))
    assert not handle.finished and not delivery.finished
    delivery.deliver(delta("", usage=True))
    assert handle.finished and delivery.finished
    handle.close()


async def test_computed_counts_the_prompt_and_each_token_until_the_usage_replaces_them() -> None:
    handle, delivery, _ = opened()
    assert handle.computed() is None  # nothing computed yet: nothing to bill
    first = protocol.Delta("r", 0, "a", num_tokens=1, prompt_tokens=12)
    delivery.deliver(first)
    delivery.deliver(protocol.Delta("r", 0, "bc", num_tokens=2))
    # A client that leaves now is billed what the engine computed for it.
    assert handle.computed() == protocol.Usage(12, 3)
    delivery.deliver(protocol.Delta("r", 0, usage=protocol.Usage(12, 4)))
    assert handle.computed() == protocol.Usage(12, 4)
    handle.close()


async def test_a_failure_keeps_what_was_computed_before_it() -> None:
    handle, delivery, _ = opened()
    delivery.deliver(protocol.Delta("r", 0, "a", num_tokens=1, prompt_tokens=5))
    delivery.deliver(WorkerLost("its connection dropped"))
    assert handle.finished
    assert handle.computed() == protocol.Usage(5, 1)
    handle.close()


async def test_next_nowait_takes_only_what_is_already_here() -> None:
    handle, delivery, _ = opened()
    assert handle.next_nowait() is None
    delivery.deliver(delta("a"))
    assert handle.next_nowait() == delta("a")
    assert handle.next_nowait() is None
    handle.close()


async def test_the_deadline_ends_the_wait_with_a_timeout() -> None:
    handle, delivery, _ = opened()
    delivery.deliver(delta("a"))
    assert await handle.next() == delta("a")
    waiting = asyncio.create_task(handle.next())
    delivery.expire()
    delivery.expire()  # found past it again: one timeout
    with pytest.raises(errors.Timeout):
        await waiting
    assert handle.next_nowait() is None  # the deadline is no item
    handle.close()


async def test_close_releases_the_request_once_however_often_it_is_called() -> None:
    handle, _, released = opened()
    handle.close()
    handle.close()
    assert released == ["r"]


async def test_a_stream_under_way_is_marked_for_the_pool() -> None:
    handle, delivery, _ = opened()
    assert not delivery.streaming
    handle.mark_streaming()
    assert delivery.streaming
    handle.close()


def test_the_record_of_who_answered_is_frozen() -> None:
    with pytest.raises(AttributeError, match="immutable"):
        WHO.address = "tcp://b:5550"  # type: ignore[misc]


SPILL = """\
pools:
  - {name: home, served_model_name: m, spill_after: 0}
  - {name: spare, served_model_name: m2, tier: 2, substitute_for: [m]}
"""


async def test_the_pool_names_the_worker_its_run_and_the_substitute_that_answered() -> None:
    pool = Pool(models=Models(config.parse(SPILL)))
    worker(pool, "home", "m", capacity=1)
    spare = worker(pool, "spare", "m2", capacity=1)
    spare.system_fingerprint = "fp-spare"
    target = pool.resolve("m", {}, [])
    first = await pool.submit(WorkOrder("a", "completion", target, {}, 0.0))
    second = await pool.submit(
        WorkOrder("b", "completion", target, {}, 0.0)
    )  # home is full: spills
    assert first.answered_by == Answerer("tcp://home:5550", "i", "m", "home", None, False)
    assert second.answered_by == Answerer("tcp://spare:5550", "i", "m2", "spare", "fp-spare", False)
    first.close()
    second.close()
    pool.workers.ctx.term()
