"""loadtest/sim_engine.py: the simulated engine's prefix cache model, and the events it
publishes as vLLM does, read by the gateway's own index."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import zmq

from gateway.dispatch.kv_index import KvIndex, block_keys, decode_batch
from gateway.dispatch.tokens import PromptTokenizer
from loadtest.sim_engine import TOKEN_ID, CacheModel, Floor, SimEngine, described_tokenizer
from shared import protocol
from shared.ports import free_port

MODEL = CacheModel(block_size=4, cache_blocks=6, prefill_s_per_token=0.0, step_s=0.0)


@pytest.fixture
def engine() -> Iterator[tuple[SimEngine, zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    described = described_tokenizer()
    port = free_port()
    sim = SimEngine(MODEL, PromptTokenizer(described), described, ctx, port, Floor())
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    yield sim, sub
    sub.close(linger=0)
    sim.shutdown()
    ctx.term()


async def complete(sim: SimEngine, tokens: list[int]) -> list[int]:
    prepared = await sim.prepare("completion", {"prompt": tokens, "max_tokens": 2})
    texts = []
    async for deltas in sim.run("r", prepared):
        texts += [d.text for d in deltas if d.text]
    return tokens


def joined(sub: zmq.Socket[bytes], sim: SimEngine) -> None:
    """The subscriber has joined: it reads a batch the engine publishes."""
    for _ in range(100):
        sim.clear()
        if sub.poll(100):
            sub.recv_multipart()
            while sub.poll(50):
                sub.recv_multipart()
            return
    pytest.fail("the simulated engine's events never arrived")


def test_a_prompts_blocks_are_cached_counted_and_published_as_vllm_does(
    engine: tuple[SimEngine, zmq.Socket[bytes]],
) -> None:
    sim, sub = engine
    joined(sub, sim)
    prompt = list(range(10, 30))  # 5 full blocks of 4
    asyncio.run(complete(sim, prompt))
    asyncio.run(complete(sim, [*prompt[:12], 99, 98, 97, 96]))  # 3 blocks shared, 1 new
    counts = sim.counts
    assert (counts.requests, counts.prompt_tokens, counts.cached_tokens) == (2, 36, 12)
    # The gateway's index reads the events: the engine holds the blocks it stored,
    # at most its 6 (5 + 1 = 6: none evicted yet).
    index = KvIndex()
    while sub.poll(200):
        index.apply("sim", decode_batch(sub.recv_multipart()[2]))
    assert index.match(block_keys(prompt, 4)) == {"sim": 5}
    assert index.blocks_of("sim") == 6


def test_the_least_recently_used_are_evicted_a_chains_tail_first(
    engine: tuple[SimEngine, zmq.Socket[bytes]],
) -> None:
    sim, sub = engine
    joined(sub, sim)
    first = list(range(100, 116))  # 4 blocks
    second = list(range(200, 216))  # 4 more: 8 > 6, two of the first's go
    asyncio.run(complete(sim, first))
    asyncio.run(complete(sim, second))
    index = KvIndex()
    while sub.poll(200):
        index.apply("sim", decode_batch(sub.recv_multipart()[2]))
    assert index.blocks_of("sim") == 6
    # The first prompt keeps its start, not its end.
    assert index.match(block_keys(first, 4)) == {"sim": 2}
    asyncio.run(complete(sim, first))
    assert sim.counts.cached_tokens == 8


def test_the_floor_counts_each_block_once_whatever_the_engine() -> None:
    floor = Floor()
    keys = block_keys(list(range(40)), 4)
    floor.add(keys, 42, 4)  # 10 blocks and 2 tokens past the last full one
    floor.add(keys[:6], 26, 4)  # all 6 seen: only the 2 tokens after them
    assert floor.tokens == 42 + 2


def test_a_restart_empties_the_cache_and_a_moved_answer_goes_on(
    engine: tuple[SimEngine, zmq.Socket[bytes]],
) -> None:
    """churn: a restarted engine holds nothing (the gateways' indexes hear it);
    a request moved from one continues with the tokens it carried, counted as
    the answer's, and its prompt is not counted in the floor again."""
    sim, sub = engine
    joined(sub, sim)
    prompt = list(range(10, 30))
    asyncio.run(complete(sim, prompt))
    sim.restart()
    index = KvIndex()
    index.apply("sim", decode_batch(sub.recv_multipart()[2]))  # the stored blocks
    index.apply("sim", decode_batch(sub.recv_multipart()[2]))  # all cleared
    assert index.blocks_of("sim") == 0 and sim.counts.requests == 1
    floor = sim.floor.tokens

    async def moved() -> list[protocol.Delta]:
        carried = protocol.Continuation([TOKEN_ID])
        params = {"prompt": prompt, "max_tokens": 3}
        prepared = await sim.prepare("completion", params, carried)
        return [d async for deltas in sim.run("r", prepared) for d in deltas]

    deltas = asyncio.run(moved())
    assert all(d.token_ids == [TOKEN_ID] for d in deltas if d.num_tokens)
    assert sum(d.num_tokens for d in deltas) == 2
    assert deltas[-1].usage == protocol.Usage(len(prompt), 3)
    assert sim.floor.tokens == floor
