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


@pytest_asyncio.fixture(loop_scope="function")
async def with_replay(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> AsyncIterator[tuple[Publisher, zmq.Socket[bytes], KvEvents]]:
    """As ``subscribed``, the worker naming a replay endpoint (a ROUTER the test answers
    from, framed as vLLM's ``ZmqEventPublisher`` answers)."""
    publisher = Publisher(ctx)
    router = ctx.socket(zmq.ROUTER)
    replay_port = free_port()
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    kv = KvEvents(ctx)
    kv.heard(ADDRESS, "first", publisher.port, 4, replay_port)
    try:
        # A batch read after batches this process missed while joining makes it
        # ask the replay for them; it gets none (the test's replay is empty).
        async with asyncio.timeout(30):
            while not router.poll(0) and kv.index.blocks_of(ADDRESS) == 0:
                publisher.publish(stored([1], None, TOKENS[:4]))
                await asyncio.sleep(0.05)
        if router.poll(0):
            answer_replay(router, [])
        await until(lambda: kv.index.blocks_of(ADDRESS) == 1)
        yield publisher, router, kv
    finally:
        kv.close()
        router.close(linger=0)
        publisher.sock.close(linger=0)


def answer_replay(router: zmq.Socket[bytes], batches: list[tuple[int, bytes]]) -> int:
    """Answer one replay request with ``batches``; returns the first sequence number asked."""
    identity, _, start = router.recv_multipart()
    for seq, payload in batches:
        router.send_multipart([identity, b"", b"", seq.to_bytes(8, "big"), payload])
    router.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
    return int.from_bytes(start, "big")


async def test_missed_batches_come_back_from_the_replay_in_order(
    with_replay: tuple[Publisher, zmq.Socket[bytes], KvEvents],
) -> None:
    publisher, router, kv = with_replay
    # Block 2 is stored in a batch this process misses; blocks 3 and 4 come
    # live after it, block 4 while the replay is asked: both wait for block 2.
    missed_seq = publisher.seq
    missed = encode(wire.EventBatch(ts=0.0, events=[stored([2], 1, TOKENS[4:8])]))
    publisher.seq += 1
    publisher.publish(stored([3], 2, TOKENS[8:12]))
    await until(lambda: router.poll(0))
    publisher.publish(stored([4], 3, TOKENS[12:16]))
    assert answer_replay(router, [(missed_seq, missed)]) == missed_seq
    await until(lambda: kv.index.blocks_of(ADDRESS) == 4)
    assert kv.index.match(block_keys(TOKENS, 4)) == {ADDRESS: 4}
    assert kv.index.orphans == 0


async def test_a_replay_that_does_not_answer_delays_nothing_for_long(
    with_replay: tuple[Publisher, zmq.Socket[bytes], KvEvents], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.dispatch import kv_events

    monkeypatch.setattr(kv_events, "REPLAY_TIMEOUT", 0.2)
    publisher, router, kv = with_replay
    publisher.seq += 1  # a batch missed, and the replay never answers
    publisher.publish(stored([5], None, TOKENS[4:8]))
    await until(lambda: router.poll(0))
    # The live batch held for the replay is applied once it is given up on.
    await until(lambda: kv.index.blocks_of(ADDRESS) == 2)
