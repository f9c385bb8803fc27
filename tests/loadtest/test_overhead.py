"""The gateway-overhead harness: its two zero-cost backends, and one real hop.

Its arithmetic is tested module by module on made-up figures (test_pinning,
test_wrk, test_overhead_report, test_profiles). The FAKE engine
(``loadtest.fake_engine``) and the zero-cost HTTP backend
(``loadtest.zero_cost_http``) are checked to answer exactly the tokens they
promise, and the fake worker to answer through a real gateway.
The measuring itself is a run of ``python -m loadtest.overhead``, not a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest import overhead_servers, wrk
from loadtest.fake_engine import TOKEN_TEXT, FakeEngine
from loadtest.overhead_servers import start_llmgate
from loadtest.pinning import plan_cores
from loadtest.wrk import Scenario
from loadtest.zero_cost_http import ZeroCostApp
from shared import protocol
from tests.conftest import PATIENCE, ROOT, Served, free_port, start_gateway, stop_serve

MODEL = "smollm2-135m-instruct"


# --- the FAKE engine ------------------------------------------------------------


async def _collect(engine: FakeEngine, params: dict[str, object]) -> list[list[protocol.Delta]]:
    prompts = await engine.prepare("completion", params)
    return [deltas async for deltas in engine.run("r1", prompts)]


async def test_fake_engine_emits_the_requested_tokens_then_usage() -> None:
    engine = FakeEngine([MODEL])
    steps = await _collect(engine, {"prompt": "one two three", "max_tokens": 3, "n": 2})
    *tokens, (last,) = steps
    assert len(tokens) == 3 and all(len(step) == 2 for step in tokens)
    assert all(d.text == TOKEN_TEXT and d.num_tokens == 1 for step in tokens for d in step)
    assert [d.finish_reason for d in tokens[-1]] == ["length", "length"]
    assert all(d.finish_reason is None for step in tokens[:-1] for d in step)
    assert last.usage == protocol.Usage(prompt_tokens=3, completion_tokens=6)
    assert engine.load() == (0, 0, 0.0)


async def test_fake_engine_fixed_token_count_overrides_max_tokens() -> None:
    steps = await _collect(FakeEngine([MODEL], tokens=5), {"prompt": "x", "max_tokens": 100})
    assert len(steps) == 5 + 1


async def test_fake_engine_keeps_its_token_interval() -> None:
    engine = FakeEngine([MODEL], token_interval=0.02)
    started = time.monotonic()
    steps = await _collect(engine, {"prompt": "x", "max_tokens": 4})
    elapsed = time.monotonic() - started
    assert len(steps) == 5
    # Three intervals between four tokens; the upper bound only says it does
    # not hang (this shared machine may stall the loop for seconds).
    assert 0.06 <= elapsed < 30


async def test_fake_engine_counts_running_requests() -> None:
    engine = FakeEngine([MODEL], token_interval=0.05)
    prompts = await engine.prepare("chat", {"messages": [{"role": "user", "content": "hi"}]})
    stream = engine.run("r1", prompts)
    await anext(stream)
    assert engine.load()[0] == 1
    await stream.aclose()
    assert engine.load()[0] == 0


# --- the zero-cost HTTP backend -------------------------------------------------


async def _post(app: ZeroCostApp, path: str, body: dict[str, object]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://zc") as client:
        return await client.post(path, json=body)


async def test_zero_cost_http_answers_completions() -> None:
    response = await _post(ZeroCostApp(), "/v1/completions", {"prompt": "a b", "max_tokens": 3})
    assert response.status_code == 200
    body = response.json()
    assert body["choices"][0]["text"] == TOKEN_TEXT * 3
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


async def test_zero_cost_http_streams_one_chunk_per_token() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    response = await _post(ZeroCostApp(), "/v1/chat/completions", body)
    assert response.headers["content-type"] == "text/event-stream"
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [c["delta"]["content"] for c in chunks] == [TOKEN_TEXT] * 4
    assert chunks[0]["delta"]["role"] == "assistant"
    assert [c["finish_reason"] for c in chunks] == [None, None, None, "length"]


async def test_zero_cost_http_serves_models_health_and_404() -> None:
    transport = httpx.ASGITransport(app=ZeroCostApp(model="m"))
    async with httpx.AsyncClient(transport=transport, base_url="http://zc") as client:
        models = await client.get("/v1/models")
        health = await client.get("/health")
        missing = await client.get("/nowhere")
        bad = await client.post("/v1/completions", content=b"{not json")
    assert [m["id"] for m in models.json()["data"]] == ["m"]
    assert health.status_code == 200
    assert missing.status_code == 404
    assert bad.status_code == 400


# --- one real hop: the fake worker behind a real gateway --------------------------


@pytest.fixture(scope="module")
def fake_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    address = f"tcp://127.0.0.1:{free_port()}"
    log_dir = tmp_path_factory.mktemp("fake-worker")
    with (log_dir / "worker.log").open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "loadtest.fake_engine", "--bind", address],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        gateway = start_gateway(log_dir / "gateway.log", address)
        try:
            yield gateway
        finally:
            stop_serve(gateway)
    finally:
        worker.terminate()
        worker.wait(10)


def test_fake_worker_answers_through_the_gateway(fake_gateway: Served) -> None:
    response = httpx.post(
        f"{fake_gateway.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "Hello there", "max_tokens": 5},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == TOKEN_TEXT * 5
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


def test_fake_worker_streams_through_the_gateway(fake_gateway: Served) -> None:
    """What the harness's check_answer accepts: one SSE chunk per token, then [DONE]."""
    wrk.check_answer(fake_gateway.base_url, Scenario("stream", 1, True, 7))
    response = httpx.post(
        f"{fake_gateway.base_url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
        },
        timeout=60,
    )
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}  # vLLM's opening chunk
    assert [d["content"] for d in deltas[1:]] == [TOKEN_TEXT] * 3


def test_fake_worker_refuses_an_unknown_model_like_a_real_one(fake_gateway: Served) -> None:
    response = httpx.post(
        f"{fake_gateway.base_url}/v1/completions",
        json={"model": "no-such-model", "prompt": "x", "max_tokens": 1},
        timeout=60,
    )
    assert response.status_code == 404


def test_many_concurrent_requests_all_complete(fake_gateway: Served) -> None:
    async def many() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=fake_gateway.base_url, timeout=30) as client:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
            return await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(50))
            )

    responses = asyncio.run(many())
    assert all(r.status_code == 200 for r in responses)
    assert all(r.json()["choices"][0]["text"] == TOKEN_TEXT * 2 for r in responses)


def test_the_ipc_target_links_gateway_and_worker_by_a_unix_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--targets ...,llmgate-ipc``: the same hop over ``ipc://``, its socket
    removed when the harness stops."""
    plan = plan_cores(sorted(os.sched_getaffinity(0)))
    # The suite's patience: each process pinned to one core that others want.
    monkeypatch.setattr(overhead_servers, "STARTUP_TIMEOUT", 600.0)
    env = {**os.environ, **PATIENCE, "PYTHONPATH": str(ROOT)}
    with contextlib.ExitStack() as stack:
        target = start_llmgate(stack, "llmgate-ipc", plan, tmp_path, env)
        wrk.check_answer(target.url, Scenario("stream", 1, True, 3))
        metrics = httpx.get(f"{target.url}/metrics", timeout=60).text
        (healthy,) = [
            sample
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
            if sample.name == "llmgate_worker_healthy"
        ]
        address = healthy.labels["worker"]
        socket_path = Path(address.removeprefix("ipc://"))
        assert address.startswith("ipc://") and socket_path.is_socket(), healthy
        assert healthy.value == 1
    assert not socket_path.parent.exists()
