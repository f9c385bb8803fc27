"""The gateway-overhead harness: its pure parts, its two zero-cost backends, and one real hop.

``loadtest.overhead``'s arithmetic (pinning, wrk's script and output,
added latency, min/median/max, the issue's targets, profiles) is tested on
made-up figures. The FAKE engine (``loadtest.fake_engine``) and the zero-cost
HTTP backend (``loadtest.zero_cost_http``) are checked to answer exactly the
tokens they promise, and the fake worker to answer through a real gateway.
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

from loadtest import overhead
from loadtest.fake_engine import TOKEN_TEXT, FakeEngine
from loadtest.overhead import CorePlan, Run, Scenario, Spread
from loadtest.zero_cost_http import ZeroCostApp
from shared import protocol
from tests.conftest import ROOT, Served, free_port, start_gateway, stop_serve

MODEL = "smollm2-135m-instruct"

# --- pinning ----------------------------------------------------------------


def test_one_core_is_shared_by_all() -> None:
    assert overhead.plan_cores([0]) == CorePlan((0,), (0,), (0,))


def test_two_cores_give_the_proxy_one_of_its_own() -> None:
    assert overhead.plan_cores([1, 0]) == CorePlan((1,), (0,), (0,))


def test_more_cores_separate_backend_and_load_generator() -> None:
    assert overhead.plan_cores([0, 1, 2]) == CorePlan((2,), (1,), (0,))
    assert overhead.plan_cores(range(8)) == CorePlan((7,), (6,), (0, 1, 2, 3, 4, 5))


def test_pinned_prefixes_taskset() -> None:
    argv = overhead.pinned((0, 2), ["wrk", "-c1"])
    assert argv[-5:] == ["taskset", "-c", "0,2", "wrk", "-c1"]
    if os.geteuid() == 0:  # root also raises the measured processes' priority
        assert argv[:3] == ["nice", "-n", str(overhead.NICENESS)]


# --- wrk ----------------------------------------------------------------------


def test_scenarios_ask_for_what_they_measure() -> None:
    by_name = overhead.scenarios(connections=32, stream_tokens=8)
    assert by_name["latency"] == Scenario("latency", 1, False, 1)
    assert by_name["throughput"].connections == 32
    body = json.loads(by_name["stream"].body())
    assert body["stream"] is True and body["max_tokens"] == 8 and body["model"] == MODEL


def test_wrk_script_posts_the_body_and_prints_json() -> None:
    script = overhead.wrk_script(b'{"prompt":"a \\"quoted\\" word"}')
    assert 'wrk.method = "POST"' in script
    assert 'wrk.body = [==[{"prompt":"a \\"quoted\\" word"}]==]' in script
    assert "done = function(summary, latency, requests)" in script
    with pytest.raises(ValueError):
        overhead.wrk_script(b'{"prompt":"]==]"}')


def test_parse_wrk_reads_the_marker_line() -> None:
    output = "Running 1s test\n" + overhead.WRK_MARKER + '{"requests":10,"errors_status":2}\n'
    figures = overhead.parse_wrk(output)
    assert figures["requests"] == 10
    assert overhead.wrk_errors({"requests": 10, "errors_status": 2, "errors_read": 1}) == 3
    with pytest.raises(ValueError):
        overhead.parse_wrk("Running 1s test\n")


def test_wrk_script_runs_under_wrk(tmp_path: Path) -> None:
    """The Lua really runs: wrk POSTs the body and prints one parseable JSON line."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "loadtest.zero_cost_http", "--port", str(port)], cwd=ROOT
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")
        script = tmp_path / "s.lua"
        script.write_text(overhead.wrk_script(Scenario("t", 1, False, 3).body()))
        done = subprocess.run(
            [
                "wrk",
                "-t1",
                "-c1",
                "-d1s",
                "-s",
                str(script),
                f"http://127.0.0.1:{port}/v1/completions",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        server.terminate()
        server.wait(10)
    figures = overhead.parse_wrk(done.stdout)
    assert figures["requests"] > 0 and overhead.wrk_errors(figures) == 0
    assert 0 < figures["latency_mean_us"] < 1e6


def test_status_field_reads_proc_status() -> None:
    text = "Name:\tpython\nVmHWM:\t  123456 kB\nVmRSS:\t  100000 kB\n"
    assert overhead.status_field(text, "VmHWM") == 123456
    assert overhead.status_field(text, "VmRSS") == 100000
    with pytest.raises(ValueError):
        overhead.status_field(text, "VmSwap")


# --- summary ------------------------------------------------------------------


def _run(target: str, scenario: str, repeat: int, **figures: float) -> Run:
    base: dict[str, float] = {
        "requests_per_s": 1000.0,
        "tokens_per_s": 0.0,
        "latency_mean_us": 100.0,
        "loadgen_cpu_util": 0.1,
        "backend_cpu_util": 0.5,
        "other_cpu_util": 0.0,
    }
    base.update(figures)
    proxy: dict[str, float | None] = {}
    if target != "direct":
        proxy = {
            "proxy_cpu_util": base.pop("proxy_cpu_util", 1.0),
            "requests_per_proxy_core_s": base.pop("requests_per_proxy_core_s", 1000.0),
            "tokens_per_proxy_core_s": base.pop("tokens_per_proxy_core_s", None),
            "proxy_cpu_s_per_1k_requests": 1.0,
            "proxy_rss_mib": 50.0,
            "proxy_peak_rss_mib": 60.0,
        }
    return Run(
        target=target,
        scenario=scenario,
        repeat=repeat,
        connections=1,
        tokens_per_request=1,
        seconds=5.0,
        requests=5000,
        errors=0,
        latency_p50_us=base["latency_mean_us"],
        latency_p99_us=base["latency_mean_us"] * 2,
        latency_max_us=base["latency_mean_us"] * 3,
        **base,
        **proxy,
    )


def test_added_latency_pairs_each_proxy_with_direct_of_the_same_repeat() -> None:
    runs = [
        _run("direct", "latency", 1, latency_mean_us=100),
        _run("llmgate", "latency", 1, latency_mean_us=220),
        _run("direct", "latency", 2, latency_mean_us=140),
        _run("llmgate", "latency", 2, latency_mean_us=250),
        _run("llmgate", "throughput", 1, latency_mean_us=9999),
    ]
    assert overhead.added_latency(runs) == {("llmgate", 1): 120, ("llmgate", 2): 110}


def test_summarize_gives_min_median_max_over_repeats() -> None:
    runs = [_run("llmgate", "throughput", i, requests_per_s=rps) for i, rps in enumerate((3, 1, 2))]
    summary = overhead.summarize(runs)
    assert summary[("throughput", "llmgate")]["requests_per_s"] == Spread(1, 2, 3, 3)
    # Non-streaming runs have no tokens/s figure, and no added latency outside "latency".
    assert "tokens_per_s" not in summary[("throughput", "llmgate")]
    assert "added_latency_us" not in summary[("throughput", "llmgate")]


def _summary_for_verdicts(added: float, rps: float, tokens: float) -> list[overhead.Verdict]:
    runs = []
    for repeat in (1, 2, 3):
        runs += [
            _run("direct", "latency", repeat, latency_mean_us=100),
            _run("llmgate", "latency", repeat, latency_mean_us=100 + added),
            _run("vllm-router", "latency", repeat, latency_mean_us=350),
            _run(
                "llmgate", "throughput", repeat, requests_per_s=rps, requests_per_proxy_core_s=rps
            ),
            _run(
                "vllm-router",
                "throughput",
                repeat,
                requests_per_s=10_000,
                requests_per_proxy_core_s=10_000,
            ),
            _run("llmgate", "stream", repeat, tokens_per_s=tokens, tokens_per_proxy_core_s=tokens),
        ]
    return overhead.verdicts(overhead.summarize(runs))


def test_verdicts_pass_at_the_targets() -> None:
    judged = _summary_for_verdicts(added=150, rps=5000, tokens=50_000)
    assert [v.passed for v in judged] == [True, True, True, True]
    assert judged[0].note == "vllm-router adds 250"


def test_verdicts_miss_below_the_targets() -> None:
    judged = _summary_for_verdicts(added=151, rps=4999, tokens=49_999)
    assert [v.passed for v in judged] == [False, False, False, False]
    assert judged[1].measured == pytest.approx(0.4999)


def test_verdicts_without_a_router_are_not_judged() -> None:
    summary = overhead.summarize([_run("llmgate", "throughput", 1)])
    ratios = [v for v in overhead.verdicts(summary) if "vllm-router" in v.name]
    assert ratios and all(v.passed is None for v in ratios)


def test_format_table_shows_median_and_range_per_target() -> None:
    runs = [
        _run(t, "latency", r, latency_mean_us=100 + r)
        for t in ("direct", "llmgate")
        for r in (1, 2, 3)
    ]
    table = overhead.format_table(overhead.summarize(runs))
    header, *rows = table.splitlines()
    assert header.split() == ["latency", "direct", "llmgate"]
    mean_row = next(r for r in rows if "latency mean" in r)
    assert "102 [101-103]" in mean_row


# --- profiles -----------------------------------------------------------------

COLLAPSED = """\
main (a.py:1);run (uvicorn/server.py:10);handle (gateway/api/openai.py:5) 6
main (a.py:1);run (uvicorn/server.py:10);encode (gateway/sse.py:3) 3
main (a.py:1);select (selectors.py:9) 1
"""


def test_top_frames_counts_self_time_at_the_leaf() -> None:
    frames, samples = overhead.top_frames(COLLAPSED)
    assert samples == 10
    assert frames[0] == ("handle (gateway/api/openai.py:5)", 0.6)
    assert frames[1] == ("encode (gateway/sse.py:3)", 0.3)


def test_self_by_component_splits_all_time_between_our_files_and_packages() -> None:
    shares = dict(overhead.self_by_component(COLLAPSED))
    assert shares == {"gateway/api/openai.py": 0.6, "gateway/sse.py": 0.3, "selectors": 0.1}


def test_inclusive_by_file_counts_each_stack_once() -> None:
    shares = dict(overhead.inclusive_by_file(COLLAPSED))
    assert shares["a.py"] == 1.0
    assert shares["uvicorn/server.py"] == 0.9
    assert shares["gateway/sse.py"] == 0.3


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


def _wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not up after {timeout}s")


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
        timeout=10,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == TOKEN_TEXT * 5
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


def test_fake_worker_streams_through_the_gateway(fake_gateway: Served) -> None:
    """What the harness's check_answer accepts: one SSE chunk per token, then [DONE]."""
    overhead.check_answer(fake_gateway.base_url, Scenario("stream", 1, True, 7))
    response = httpx.post(
        f"{fake_gateway.base_url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
        },
        timeout=10,
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
        timeout=10,
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


def test_the_ipc_target_links_gateway_and_worker_by_a_unix_socket(tmp_path: Path) -> None:
    """``--targets ...,llmgate-ipc``: the same hop over ``ipc://``, its socket
    removed when the harness stops."""
    plan = overhead.plan_cores(sorted(os.sched_getaffinity(0)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with contextlib.ExitStack() as stack:
        target = overhead.start_llmgate(stack, "llmgate-ipc", plan, tmp_path, env)
        overhead.check_answer(target.url, Scenario("stream", 1, True, 3))
        metrics = httpx.get(f"{target.url}/metrics", timeout=10).text
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
