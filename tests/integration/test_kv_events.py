"""The workers' KV cache events, read by the gateway (gateway/dispatch/kv_events.py): the
session's worker publishes them (vLLM's ``--kv-events-config``) and says where in its
heartbeats; the gateway's index of its cache fills as its engine computes a prompt."""

from __future__ import annotations

import uuid

import httpx

from tests.conftest import MODEL, Served
from tests.integration.test_pool import metric, wait_for

# About 600 tokens: many full blocks whatever the engine's block size.
PROMPT = "The lighthouse keeper counted the ships. " * 75


def blocks(served: Served) -> float:
    return (
        metric(served.base_url, "llmgate_kv_index_blocks", worker=served.worker_addresses(1)) or 0
    )


def test_the_index_holds_the_blocks_the_engine_computed(served: Served) -> None:
    before = blocks(served)
    answer = httpx.post(
        f"{served.base_url}/v1/completions",
        # A prompt no earlier request computed: none of its blocks is cached yet.
        json={"model": MODEL, "prompt": f"{uuid.uuid4().hex} {PROMPT}", "max_tokens": 1},
        headers={"cache-control": "no-cache, no-store"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    prompt_tokens = answer.json()["usage"]["prompt_tokens"]
    # The engine stores the prompt's full blocks and publishes them: the
    # gateway's count of the worker's blocks grows by them (metrics are
    # written out each second: waited for, not slept on).
    wait_for(lambda: blocks(served) >= before + prompt_tokens // 128, 60)
    assert blocks(served) > before
