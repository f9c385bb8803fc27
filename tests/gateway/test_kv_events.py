"""gateway/dispatch/kv_events.py: a worker's KV cache events, read from its ZeroMQ
publisher (framed as vLLM's: topic, sequence number, msgpack batch) into the index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
import pytest_asyncio
import zmq

from gateway import metrics
from gateway.dispatch import kv_index as wire
from gateway.dispatch.kv_events import KvEvents
from gateway.dispatch.kv_index import block_keys
from shared.ports import free_port
from tests.harness.waiting import until

ADDRESS = "tcp://127.0.0.1:5550"  # the worker's link address: its host is the publisher's
TOKENS = list(range(16))
encode = msgspec.msgpack.Encoder().encode


class Publisher:
    """A worker engine's KV events publisher, as vLLM frames them."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.port = free_port()
        self.sock = ctx.socket(zmq.PUB)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.seq = 0

    def publish(self, *events: object, skip: int = 0) -> None:
        self.seq += skip
        payload = encode(wire.EventBatch(ts=0.0, events=list(events)))
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> wire.BlockStored:
    return wire.BlockStored(hashes, parent, tokens, 4)


@pytest_asyncio.fixture(loop_scope="function")
async def subscribed(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> AsyncIterator[tuple[Publisher, KvEvents]]:
    """A worker's publisher, and a process subscribed to it that has read its first block."""
    publisher = Publisher(ctx)
    kv = KvEvents(ctx)
    kv.heard(ADDRESS, "first", publisher.port, 4)
    try:
        # A SUB socket misses what is sent before it has joined: send until it reads.
        async with asyncio.timeout(30):
            while kv.index.blocks_of(ADDRESS) == 0:
                publisher.publish(stored([1], None, TOKENS[:4]))
                await asyncio.sleep(0.05)
        yield publisher, kv
    finally:
        kv.close()
        publisher.sock.close(linger=0)


async def test_a_workers_events_fill_the_index_and_a_restart_empties_it(
    subscribed: tuple[Publisher, KvEvents],
) -> None:
    publisher, kv = subscribed
    publisher.publish(stored([2, 3], 1, TOKENS[4:12]))
    await until(lambda: kv.index.blocks_of(ADDRESS) == 3)
    assert kv.index.match(block_keys(TOKENS, 4)) == {ADDRESS: 3}
    assert kv.block_size(ADDRESS) == 4
    # The same incarnation again: nothing changes.
    kv.heard(ADDRESS, "first", publisher.port, 4)
    assert kv.index.blocks_of(ADDRESS) == 3
    # A new incarnation: it restarted, its cache is empty.
    kv.heard(ADDRESS, "second", publisher.port, 4)
    assert kv.index.match(block_keys(TOKENS, 4)) == {}


async def test_missed_batches_are_counted(subscribed: tuple[Publisher, KvEvents]) -> None:
    publisher, kv = subscribed
    gaps = metrics.KV_EVENTS_GAPS.labels(ADDRESS)
    before = gaps._value.get()
    publisher.publish(stored([2], 1, TOKENS[4:8]), skip=5)
    await until(lambda: kv.index.blocks_of(ADDRESS) == 2)
    assert gaps._value.get() == before + 1


async def test_a_worker_that_leaves_leaves_nothing(subscribed: tuple[Publisher, KvEvents]) -> None:
    _, kv = subscribed
    kv.forget(ADDRESS)
    assert kv.index.match(block_keys(TOKENS, 4)) == {}
    assert kv.block_size(ADDRESS) == 0
