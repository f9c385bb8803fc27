"""A gateway process that subscribes to a worker's KV events late catches up through
the publisher's replay endpoint (gateway/dispatch/kv_events.py), against vLLM's own
``ZmqEventPublisher``: what the engine published before the process joined is indexed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import zmq
from vllm.distributed import kv_events as vllm_events

from gateway import metrics
from gateway.dispatch.kv_events import KvEvents
from gateway.dispatch.kv_index import block_keys
from shared.ports import free_port
from tests.harness.waiting import until

ADDRESS = "tcp://127.0.0.1:5550"
BLOCK = 4
TOKENS = list(range(100, 100 + 1000 * BLOCK))


def stored(n: int) -> vllm_events.KVEventBatch:
    """The engine stored block ``n`` of TOKENS (its parent: block n - 1)."""
    return vllm_events.KVEventBatch(
        ts=0.0,
        events=[
            vllm_events.BlockStored(
                block_hashes=[1000 + n],
                parent_block_hash=1000 + n - 1 if n else None,
                token_ids=TOKENS[n * BLOCK : (n + 1) * BLOCK],
                block_size=BLOCK,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
    )


@pytest.fixture
def publisher() -> Iterator[tuple[vllm_events.ZmqEventPublisher, int, int]]:
    port, replay_port = free_port(), free_port()
    published = vllm_events.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}",
    )
    yield published, port, replay_port
    published.shutdown()


async def test_a_late_subscriber_catches_up_through_the_replay(
    publisher: tuple[vllm_events.ZmqEventPublisher, int, int],
) -> None:
    published, port, replay_port = publisher
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    # The engine computed a prompt's first six blocks before this process
    # joined: sent, as another subscriber's receiving the last of them shows.
    probe = ctx.socket(zmq.SUB)
    probe.setsockopt(zmq.SUBSCRIBE, b"")
    probe.connect(f"tcp://127.0.0.1:{port}")
    n, last_heard = 0, -1
    for _ in range(150):  # polls of 200 ms: 30 s at most
        if n >= 6 and last_heard == n - 1:
            break
        if n < 6 or last_heard < 0:  # six at least, and until the probe has joined
            published.publish(stored(n))
            n += 1
        if probe.poll(200):
            last_heard = int.from_bytes(probe.recv_multipart()[1], "big")
    else:
        pytest.fail("the publisher's batches never reached a subscriber")
    probe.close(linger=0)
    kv = KvEvents(ctx)
    gaps = metrics.KV_EVENTS_GAPS.labels(ADDRESS)
    before = gaps._value.get()
    try:
        kv.heard(ADDRESS, "one", port, BLOCK, replay_port)
        # A SUB socket misses what is sent before it has joined: the engine goes
        # on storing blocks until this process reads one; what it missed, it asks.
        async with asyncio.timeout(30):
            while kv.index.blocks_of(ADDRESS) == 0:
                published.publish(stored(n))
                n += 1
                await asyncio.sleep(0.2)
        await until(lambda: kv.index.blocks_of(ADDRESS) == n)
        # Every block, those published before it joined included, in one chain.
        assert kv.index.match(block_keys(TOKENS[: n * BLOCK], BLOCK)) == {ADDRESS: n}
        assert kv.index.orphans == 0
        assert gaps._value.get() == before + 1
    finally:
        kv.close()
        ctx.term()
