"""gateway/dispatch/kv_index.py: every worker's cached blocks, from vLLM's KV events.

Events go through msgpack as a worker's engine publishes them; that the
gateway's classes read vLLM's own encoding is tests/worker/test_kv_events_wire.py.
"""

from __future__ import annotations

import msgspec

from gateway.dispatch import kv_index as wire
from gateway.dispatch.kv_index import EventBatch, KvIndex, block_keys, decode_batch

BLOCK = 4
encode = msgspec.msgpack.Encoder().encode


def stored(hashes: list[int], parent: int | None, tokens: list[int], lora: str | None = None):
    return wire.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BLOCK,
        lora_id=1 if lora else None,
        medium="GPU",
        lora_name=lora,
    )


def removed(hashes: list[int]):
    return wire.BlockRemoved(block_hashes=hashes, medium="GPU")


def batch(*events: object) -> EventBatch:
    """The events as one worker publishes them: vLLM's batch, over the wire."""
    return decode_batch(encode(wire.EventBatch(ts=1.0, events=list(events))))


PROMPT = list(range(100, 113))  # three full blocks of 4, and one token more


def test_a_prompt_matches_the_leading_blocks_each_worker_holds() -> None:
    index = KvIndex()
    # a holds all three blocks (stored in two events: the second names its parent).
    index.apply("a", batch(stored([11, 12], None, PROMPT[:8])))
    index.apply("a", batch(stored([13], 12, PROMPT[8:12])))
    # b holds the first block only, and another second block.
    index.apply("b", batch(stored([21, 22], None, [*PROMPT[:4], 9, 9, 9, 9])))
    keys = block_keys(PROMPT, BLOCK)
    assert len(keys) == 3
    assert index.match(keys) == {"a": 3, "b": 1}
    assert len(index) == 4
    # The same content hashes alike whatever vLLM called it.
    assert index.match(block_keys([*PROMPT[:4], 9, 9, 9, 9], BLOCK)) == {"a": 1, "b": 2}


def test_removed_blocks_and_cleared_caches_no_longer_match() -> None:
    index = KvIndex()
    index.apply("a", batch(stored([11, 12, 13], None, PROMPT[:12])))
    index.apply("b", batch(stored([21, 22, 23], None, PROMPT[:12])))
    keys = block_keys(PROMPT, BLOCK)
    index.apply("a", batch(removed([12])))  # evicted: a's chain stops at one block
    assert index.match(keys) == {"a": 1, "b": 3}
    index.apply(
        "b",
        decode_batch(encode(wire.EventBatch(ts=1.0, events=[wire.AllBlocksCleared()]))),
    )
    assert index.match(keys) == {"a": 1}
    assert index.blocks_of("b") == 0
    index.drop("a")  # left, or restarted
    assert index.match(keys) == {}
    assert len(index) == 0


def test_a_block_whose_parent_was_never_seen_is_not_indexed() -> None:
    index = KvIndex()
    index.apply("a", batch(stored([13], 12, PROMPT[8:12])))  # its parent's event was missed
    assert index.orphans == 1
    assert len(index) == 0


def test_adapters_never_share_blocks_with_the_base_model() -> None:
    index = KvIndex()
    index.apply("a", batch(stored([11], None, PROMPT[:4], lora="sql")))
    assert index.match(block_keys(PROMPT, BLOCK)) == {}
    assert index.match(block_keys(PROMPT, BLOCK, lora="sql")) == {"a": 1}


def test_a_dropped_workers_bit_serves_the_next_worker_cleanly() -> None:
    index = KvIndex()
    index.apply("a", batch(stored([11], None, PROMPT[:4])))
    index.drop("a")
    index.apply("c", batch(stored([31], None, PROMPT[4:8])))
    assert index.match(block_keys(PROMPT, BLOCK)) == {}
    assert index.match(block_keys(PROMPT[4:8], BLOCK)) == {"c": 1}
