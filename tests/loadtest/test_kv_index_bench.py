"""loadtest/kv_index_bench.py at a small size: each figure comes from a real index."""

from __future__ import annotations

import argparse

import pytest

from loadtest import kv_index_bench

ARGS = argparse.Namespace(
    workers=4,
    block_size=4,
    cache_blocks=64,
    events=2_000,
    blocks=4_000,
    prompt_tokens=200,
    match_runs=20,
)


def test_absorbed_counts_every_block_event_it_applies() -> None:
    absorbed = kv_index_bench.absorbed(ARGS)
    assert absorbed["block_events"] >= ARGS.events
    # Each simulated engine keeps at most its cache; shared system prompts are one block.
    assert 0 < absorbed["blocks_indexed_at_end"] <= ARGS.workers * ARGS.cache_blocks


def test_memory_is_measured_over_the_blocks_asked_for() -> None:
    memory = kv_index_bench.memory(ARGS)
    assert memory["blocks"] == ARGS.blocks
    assert memory["bytes_per_block"] > 0


def test_match_walks_the_prompts_blocks() -> None:
    match = kv_index_bench.match(ARGS)
    assert match["blocks"] == ARGS.prompt_tokens // ARGS.block_size
    assert 0 < match["p50_us"] <= match["p99_us"]


def test_the_decision_routes_a_chat_of_about_the_size_asked() -> None:
    decided = kv_index_bench.decision(ARGS)
    if decided is None:
        pytest.skip("the embedded model is not converted")
    assert decided["prompt_tokens"] >= ARGS.prompt_tokens
    for case in ("warm", "cold"):
        assert decided[case]["runs"] >= 10
        assert 0 < decided[case]["p50_us"] <= decided[case]["p99_us"]
