"""The gateway's KV-event classes (gateway/dispatch/kv_index.py) read what vLLM's engine
publishes: batches built and encoded with vLLM's own classes."""

from __future__ import annotations

import msgspec
from vllm.distributed import kv_events as vllm_events

from gateway.dispatch.kv_index import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

encode = msgspec.msgpack.Encoder().encode


def test_vllms_events_decode_as_the_gateway_reads_them() -> None:
    sent = vllm_events.KVEventBatch(
        ts=1.5,
        events=[
            vllm_events.BlockStored(
                block_hashes=[11, b"\x01\x02"],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            vllm_events.BlockRemoved(block_hashes=[11], medium="GPU"),
            vllm_events.AllBlocksCleared(),
        ],
    )
    stored, removed, cleared = decode_batch(encode(sent)).events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [11, b"\x01\x02"]
    assert (stored.parent_block_hash, stored.block_size) == (None, 16)
    assert stored.token_ids == list(range(32))
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [11]
    assert isinstance(cleared, AllBlocksCleared)
