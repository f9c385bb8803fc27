"""``make bench``'s pure parts: statistics, SSE parsing, targets, table, ratios, batching.

No engine and no server: the end-to-end check is a bench run
(``python -m loadtest.bench --targets ... --duration 5``), which prints its table.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from loadtest import bench, targets
from loadtest.closed_loop import (
    Sample,
    Stats,
    chunk_text,
    completion_payload,
    parse_sse_line,
    run_closed_loop,
    summarize,
    usage_tokens,
)


def stats(target: str, rps: float, ok: int = 10) -> Stats:
    return Stats(target, rps, rps * 10, 100.0, 200.0, 50.0, 5.0, ok, 0, 10.0)


def test_sample_ttft_and_inter_token_gaps_come_from_text_events() -> None:
    sample = Sample(start=1.0, end=2.0, output_tokens=3, token_times=[1.25, 1.5, 2.0])
    assert sample.ttft == 0.25
    assert sample.itls == [0.25, 0.5]
    assert Sample(start=1.0, end=2.0).ttft is None


def test_summarize_counts_successes_and_names_errors() -> None:
    samples = [
        Sample(0.0, 1.0, 10, [0.2, 0.5, 1.0]),
        Sample(0.0, 3.0, 10, [1.0, 2.0, 3.0]),
        Sample(0.0, 0.1, 0, [], error="HTTP 429"),
    ]
    result = summarize("t", samples, window_start=-1.0, window_end=3.0)
    assert (result.ok, result.errors, result.error_kinds) == (2, 1, {"HTTP 429": 1})
    assert result.requests_per_s == 0.5 and result.measured_s == 4.0
    assert result.output_tokens_per_s == 20 / 4
    assert result.p50_ms == pytest.approx(2000.0)
    assert result.mean_ttft_ms == pytest.approx(600.0)
    # Gaps 0.3, 0.5, 1.0, 1.0: the mean over every gap, not over requests.
    assert result.mean_itl_ms == pytest.approx(700.0)


def test_summarize_without_successes_reports_no_latency() -> None:
    result = summarize("t", [Sample(0.0, 1.0, error="ConnectError")], 0.0, 1.0)
    assert result.requests_per_s == 0 and result.p50_ms is None and result.mean_itl_ms is None


def test_tokens_count_where_they_arrive_also_from_requests_cut_by_the_window() -> None:
    before = Sample(0.0, 1.5, 4, [0.5, 0.8, 1.2, 1.5])  # started in the warmup
    running = Sample(1.5, 0.0, 0, [1.8, 2.5, 3.5])  # still streaming at the end
    batched = Sample(1.0, 2.0, 4, [1.5, 2.0])  # two tokens per event, per its usage
    result = summarize("t", [before, running, batched], window_start=1.0, window_end=3.0)
    assert result.ok == 2  # the running one is not a finished request
    assert result.output_tokens_per_s == (2 + 2 + 4) / 2.0


def test_without_streams_tokens_are_those_of_finished_requests() -> None:
    samples = [Sample(0.0, 1.5, 10), Sample(0.5, 2.5, 10), Sample(1.0, 0.0)]
    assert summarize("t", samples, 1.0, 3.0).output_tokens_per_s == 10.0


async def test_closed_loop_keeps_only_requests_that_end_inside_the_window() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    in_flight = 0
    most_in_flight = 0

    async def send(sample: Sample) -> None:
        nonlocal in_flight, most_in_flight
        in_flight += 1
        most_in_flight = max(most_in_flight, in_flight)
        try:
            await asyncio.sleep(0.02)
            sample.token_times.append(time.perf_counter())
            sample.output_tokens = 1
            sample.end = time.perf_counter()
        finally:
            in_flight -= 1

    # A 3 s window: a stall of this shared machine's test process (seconds
    # have been seen, and the CPU snapshot at the window's start takes a
    # while at a small share of a core) does not span all of it.
    run = await run_closed_loop(send, users=3, warmup=0.05, duration=3.0)
    samples, start, end = run.window()
    assert most_in_flight == 3  # each user waits for its answer before sending again
    assert end - start == pytest.approx(3.0)
    assert in_flight == 0  # cancelled at the window's end, not left running
    # It returns at the window's end, not after the users' next requests (a
    # loose bound, "not hung": this machine is shared).
    assert loop.time() - started < 30
    result = summarize("t", samples, start, end, run.cpu_cores)
    # Cores by kind of process over the window: none negative, and together
    # with the idle ones no more than the machine has (some slack for the
    # two snapshots not being instants).
    assert all(cores >= 0 for cores in result.cpu_cores.values())
    assert 0 < sum(result.cpu_cores.values()) <= 1.5 * os.cpu_count()  # type: ignore[operator]
    # 3 users x (3 s / 0.02 s) = at most about 450 requests in the window,
    # none from the warmup (fewer when this shared machine stalls the loop).
    assert 1 <= result.ok <= 453 and result.ok < len(samples)


def test_payload_is_greedy_fixed_length_and_asks_for_usage_when_streaming() -> None:
    streamed = completion_payload("m", "hi", 10, stream=True)
    assert streamed["temperature"] == 0.0 and streamed["ignore_eos"] is True
    assert streamed["stream_options"] == {"include_usage": True}
    assert "stream_options" not in completion_payload("m", "hi", 10, stream=False)


def test_sse_lines_parse_to_chunks_and_skip_the_rest() -> None:
    chunk = {"choices": [{"index": 0, "text": "Hel"}], "usage": None}
    assert parse_sse_line("data: " + json.dumps(chunk)) == chunk
    assert parse_sse_line("data: [DONE]") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("") is None
    assert chunk_text(chunk) == "Hel"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 10}}) == ""
    assert usage_tokens({"usage": {"completion_tokens": 10}}) == 10
    assert usage_tokens({"usage": None}) is None


def test_targets_keep_the_bench_order_and_refuse_unknown_names() -> None:
    assert targets.parse_targets("vllm-direct, llmgate-1") == ["llmgate-1", "vllm-direct"]
    assert targets.parse_targets("all") == list(targets.TARGETS)
    with pytest.raises(ValueError, match="unknown targets"):
        targets.parse_targets("llmgate-3")
    with pytest.raises(ValueError, match="no targets"):
        targets.parse_targets(" , ")


def test_engine_env_pins_a_slice_with_no_reserved_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    alone = targets.engine_env()
    assert alone["VLLM_CPU_KVCACHE_SPACE"] == targets.KV_CACHE_GIB
    assert "VLLM_CPU_OMP_THREADS_BIND" not in alone  # vLLM binds a lone engine itself
    assert alone["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # as llmgate serve's worker
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in targets.engine_env(vllm_default=True)
    pinned = targets.engine_env("1")
    assert pinned["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert pinned["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_every_engine_gets_the_same_flags() -> None:
    engine = targets.Engine(enforce_eager=True, startup_timeout=1.0)
    direct = targets.vllm_server_argv(8000, engine)
    served = targets.llmgate_argv(8001, 9000, 2, engine)
    assert direct[-1] == served[-1] == "--enforce-eager"
    assert "float32" in direct and "--num-workers" in served
    router = targets.router_argv(8002, ["http://a", "http://b"])
    assert router[router.index("--worker-urls") + 1 : router.index("--policy")] == [
        "http://a",
        "http://b",
    ]
    assert targets.vllm_server_argv(8000, targets.Engine(False, 1.0))[-1] != "--enforce-eager"


def test_ratios_use_only_targets_that_ran_and_served() -> None:
    results = [stats("llmgate-1", 12.0), stats("vllm-direct", 10.0), stats("vllm-router-2", 0, 0)]
    results[0].output_tokens_per_s = 132.0  # the ratios compare tokens/s
    assert bench.ratios(results) == {"llmgate-1 / vllm-direct": pytest.approx(1.32)}


def test_table_has_one_row_per_target_and_dashes_for_missing_figures() -> None:
    missing = Stats("fastapi-batching", 0.0, 0.0, None, None, None, None, 0, 3, 10.0)
    table = bench.format_table([stats("llmgate-1", 12.0), missing]).splitlines()
    assert table[0].split() == "target req/s tok/s p50 ms p99 ms TTFT ms ITL ms ok errors".split()
    assert table[1].split()[:3] == ["llmgate-1", "12.00", "120.0"]
    assert table[2].split()[3:7] == ["-", "-", "-", "-"]


def test_results_are_written_as_json_and_csv(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    args = bench.build_parser().parse_args(["--targets", "llmgate-1", "--duration", "3"])
    bench.write_results(tmp_path, datetime.now(UTC), args, [stats("llmgate-1", 12.0)])
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["results"][0]["target"] == "llmgate-1"
    assert document["parameters"]["duration"] == 3.0
    header, row = (tmp_path / "results.csv").read_text().splitlines()
    assert header.startswith("target,requests_per_s") and row.startswith("llmgate-1,12.0")
    assert bench.stats_from_dict(document["results"][0]) == stats("llmgate-1", 12.0)


def test_long_flag_sets_128_token_outputs() -> None:
    args = bench.build_parser().parse_args(["--long"])
    assert args.long and args.enforce_eager and args.stream


# --- the FastAPI batching baseline's bookkeeping (no model) ----------------


async def test_baseline_stops_each_request_at_its_own_length_or_eos() -> None:
    from loadtest.baselines.fastapi_batching import Batcher, Pending

    batcher = Batcher(None, SimpleNamespace(eos_token_id=2), max_batch=50, timeout=0.1)
    short, long, eos, forced = (
        Pending("a", 1, False),
        Pending("b", 3, False),
        Pending("c", 3, False),
        Pending("d", 3, True),
    )
    batch = [short, long, eos, forced]
    batcher.dispatch(batch, [7, 7, 2, 2])
    batcher.dispatch(batch, [8, 8, 2, 8])
    batcher.finish(batch)

    def drained(pending: Pending) -> list[int | None]:
        return [pending.tokens.get_nowait() for _ in range(pending.tokens.qsize())]

    assert drained(short) == [7, None] and short.finish_reason == "length"
    assert drained(long) == [7, 8, None] and long.finish_reason == "stop"
    assert drained(eos) == [None] and eos.finish_reason == "stop"
    assert drained(forced) == [2, 8, None] and forced.produced == 2


async def test_baseline_batches_up_to_its_maximum() -> None:
    from loadtest.baselines.fastapi_batching import Batcher, Pending

    batches: list[int] = []
    two = asyncio.Event()

    class Recording(Batcher):
        def generate(self, batch: list[Pending], loop: asyncio.AbstractEventLoop) -> None:
            batches.append(len(batch))  # in a thread (asyncio.to_thread)
            if len(batches) == 2:
                loop.call_soon_threadsafe(two.set)

    batcher = Recording(None, SimpleNamespace(eos_token_id=2), max_batch=4, timeout=0.05)
    for _ in range(6):
        batcher.incoming.put_nowait(Pending("p", 1, False))
    task = asyncio.create_task(batcher.run())
    async with asyncio.timeout(30):
        await two.wait()
    task.cancel()
    assert batches == [4, 2]


def test_on_a_gpu_host_one_and_two_gpu_targets_get_their_devices() -> None:
    gpu = targets.Engine(False, 60, model_dir="/models/qwen", dtype="auto", gpus=2)
    assert gpu.gpu_env(1) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert gpu.gpu_env(2) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert gpu.gpu_env([1]) == {"CUDA_VISIBLE_DEVICES": "1"}
    with pytest.raises(RuntimeError, match="needs 3 GPUs; 2 visible"):
        gpu.gpu_env(3)
    assert targets.Engine(False, 60).gpu_env(2) == {}  # CPU: cores, not GPUs


def test_a_model_from_the_hosts_disk_reaches_every_server() -> None:
    gpu = targets.Engine(False, 60, model_dir="/models/qwen", dtype="auto", gpus=2)
    vllm = " ".join(targets.vllm_server_argv(8000, gpu))
    assert "--model /models/qwen" in vllm and "--dtype auto" in vllm
    assert f"--served-model-name {targets.MODEL}" in vllm
    llmgate = " ".join(targets.llmgate_argv(8000, 5550, 2, gpu))
    assert "--model /models/qwen" in llmgate and f"--served-model-name {targets.MODEL}" in llmgate
    embedded = " ".join(targets.llmgate_argv(8000, 5550, 1, targets.Engine(True, 60)))
    assert "--model" not in embedded.replace("--model-", "") and "--dtype float32" in embedded


def test_the_gpu_scripts_bench_flags_parse() -> None:
    script = (Path(bench.__file__).parent / "gpu_bench.sh").read_text()
    assert "--no-enforce-eager" in script and "--dtype auto" in script
    args = bench.build_parser().parse_args(
        ["--targets", "all", "--long", "--no-enforce-eager", "--model", "/m", "--dtype", "auto"]
    )
    assert (args.model, args.dtype, args.enforce_eager, args.long) == ("/m", "auto", False, True)
