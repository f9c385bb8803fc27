"""CPU layouts as real engines take them: ``llmgate serve``'s default (every
core, none held back for vLLM's front end) is checked where a system of its
own starts (``tests/integration/test_launcher_processes.py``); here, the
session's worker, whose environment sets ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``
(``tests/conftest.py``), shows the environment winning over the default,
its KV cache the CPU default's 32-token blocks, and vLLM's engine core
sleeping while the model computes."""

from __future__ import annotations

import os
import re
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest import capacity
from tests.conftest import MODEL, Served
from tests.harness.at_once import at_once, raised
from worker.main import CPU_BLOCK_SIZE


def vllm_binding(log: str) -> list[int]:
    """The cores vLLM's engine bound its compute threads to, from its log."""
    bound = re.search(r"core ids=\[([\d, ]+)\]", log)
    assert bound is not None, "vLLM's thread binding line is missing"
    return [int(c) for c in bound.group(1).split(",")]


def test_the_environment_wins_over_the_cpu_default(served: Served) -> None:
    cores = sorted(os.sched_getaffinity(0))
    served.wait_for_log(
        f"CPU layout, {len(cores)} usable cores: worker-0 on cores all {len(cores)} "
        "(reserved for its front end: 1)"
    )
    log = served.wait_for_log("reserve_cpu_num=1")
    assert vllm_binding(log) == cores[:-1]


def prefix_cache(metrics_url: str) -> tuple[float, float]:
    """(queries, hits) of the worker's prefix cache, in tokens (vLLM's metrics)."""
    values = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=30).text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


def test_a_cpu_worker_reuses_prefixes_in_32_token_blocks(served: Served) -> None:
    # llmgate's CPU default (worker.main.CPU_BLOCK_SIZE), vLLM's own being 128:
    # a prompt under 128 tokens, sent twice, is then found in the cache up to
    # its last whole 32-token block (the last token is always computed anew).
    served.wait_for_log(f"CPU engine: KV-cache blocks of {CPU_BLOCK_SIZE} tokens")
    url = f"http://127.0.0.1:{served.worker_metrics_port}/metrics"
    prompt = " ".join(f"word{i}" for i in range(30)) + f" {time.time_ns()}"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}

    def send() -> tuple[int, float]:
        """The prompt's length in tokens, and the cache hits it found."""
        queries, hits = prefix_cache(url)
        response = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        prompt_tokens = response.json()["usage"]["prompt_tokens"]
        deadline = time.monotonic() + 30
        while prefix_cache(url)[0] < queries + prompt_tokens:  # counted once the step ends
            assert time.monotonic() < deadline, "vLLM's prefix-cache metrics did not move"
            time.sleep(0.1)
        return prompt_tokens, prefix_cache(url)[1] - hits

    prompt_tokens, first_hits = send()
    assert 64 < prompt_tokens < 128, prompt_tokens
    assert first_hits == 0  # a prompt of its own
    _, hits = send()
    assert hits == (prompt_tokens - 1) // CPU_BLOCK_SIZE * CPU_BLOCK_SIZE, (prompt_tokens, hits)


def test_vllms_engine_core_sleeps_while_the_model_computes(served: Served) -> None:
    # The session's engine computes on core 0 and leaves core 1 to the rest
    # (tests/conftest.py). vLLM's engine core waits for each step's result
    # spinning for up to 1 s: under load, for as long as the model computes,
    # a core burnt (measured: 23.9 CPU-s of 24.8 s while its model runner
    # used 24.4). The worker caps that spin (--engine-busy-wait, 2 ms).
    served.wait_for_log("CPU engine: vLLM's processes spin at most 0.002 s")
    # vLLM's engine core and model runner under the session's worker, as the
    # soak labels them (vLLM names them with setproctitle).
    roles = capacity.server_processes(served.proc.pid, split_engine=True)
    (engine_core,) = roles["worker/VLLM::EngineCore"]
    (model_runner,) = roles["worker/VLLM::Worker"]
    processes = {"Engine": engine_core, "Worker": model_runner}
    before = {name: sum(p.cpu_times()[:2]) for name, p in processes.items()}
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 96, "ignore_eos": True}

    def send(index: int) -> None:
        response = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, (index, response.text)

    assert not raised(at_once(4, send))
    used = {name: sum(p.cpu_times()[:2]) - before[name] for name, p in processes.items()}
    assert used["Worker"] > 2, used  # the model computed for a while
    assert used["Engine"] < used["Worker"] / 3, used
