"""Batch jobs and the response cache, measured: the ``batch`` scenario of ``make loadtest``.

One ``llmgate serve --cache memory`` (one worker, the embedded model,
``--enforce-eager``), a fresh state directory in the run's directory, then:

1. **Interactive, idle**: ``--interactive-users`` closed-loop users send
   sampled chat requests (``--interactive-tokens`` tokens, temperature 0.7,
   so never cached) for ``--interactive-seconds``: latency p50/p99.
2. **Interactive, under a batch**: a batch job of ``--batch-lines`` lines
   (``--batch-tokens`` tokens each, sampled, ``ignore_eos``) is created, and
   the same interactive load runs while it is in progress: latency p50/p99,
   and the ratio of p50 to the idle p50 (target: at most 1.25).
3. **Batch alone on an idle pool**: the same batch, nothing else running:
   lines per second from creation to ``completed``; then the same requests
   sent interactively by ``--direct-concurrency`` concurrent clients: requests
   per second. Target: the batch at least 0.8x the interactive rate.
4. **Cache**: ``--cache-requests`` distinct deterministic chat requests
   (temperature 0), each sent twice: latency of the misses and of the hits.
   Then precompute: a batch of other such requests with metadata
   ``{"llmgate_cache": "true"}``, and the same requests interactively: how
   many hit, and their latency.

Writes ``summary.json`` into the run's directory and prints a table.

    make loadtest ARGS="--scenario batch"
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from loadtest.percentiles import observed_percentile
from loadtest.procs import await_ready, launched, served_model
from loadtest.report import ROOT
from shared.ports import free_port, free_port_range

STARTUP_TIMEOUT_S = 600.0
CHAT = "/v1/chat/completions"
TOPICS = ("rivers", "mountains", "birds", "trees", "stars", "ships", "bridges", "clocks")


def latency_stats(latencies: list[float]) -> dict[str, Any]:
    if not latencies:
        return {"requests": 0, "p50_s": None, "p99_s": None, "mean_s": None}
    return {
        "requests": len(latencies),
        "p50_s": observed_percentile(latencies, 0.5),
        "p99_s": observed_percentile(latencies, 0.99),
        "mean_s": statistics.fmean(latencies),
    }


def sampled_body(model: str, i: int, tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}],
        "max_tokens": tokens,
        "temperature": 0.7,
        "ignore_eos": True,
    }


def greedy_body(model: str, i: int, tokens: int, tag: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"{tag} question {i}: what is {i} plus {i}?"}],
        "max_tokens": tokens,
        "temperature": 0,
    }


async def interactive(
    url: str, model: str, users: int, seconds: float, tokens: int, until: asyncio.Event | None
) -> list[float]:
    """Closed-loop users for ``seconds`` (or until ``until`` is set): each request's latency."""
    latencies: list[float] = []
    stop_at = time.monotonic() + seconds

    async def user(index: int, client: httpx.AsyncClient) -> None:
        i = index
        while time.monotonic() < stop_at and not (until is not None and until.is_set()):
            started = time.monotonic()
            response = await client.post(CHAT, json=sampled_body(model, i, tokens))
            if response.status_code == 200:
                latencies.append(time.monotonic() - started)
            i += users

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(user(u, client) for u in range(users)))
    return latencies


def batch_input(bodies: list[dict[str, Any]]) -> bytes:
    lines = [
        json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": CHAT, "body": body})
        for i, body in enumerate(bodies)
    ]
    return ("\n".join(lines) + "\n").encode()


def create_batch(
    client: openai.OpenAI, bodies: list[dict[str, Any]], metadata: dict[str, str] | None = None
) -> str:
    upload = client.files.create(
        file=("batch.jsonl", io.BytesIO(batch_input(bodies))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint=CHAT,
        completion_window="24h",
        metadata=metadata,
    )
    return batch.id


def wait_for_batch(client: openai.OpenAI, batch_id: str, timeout: float = 3600) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch_id} still {batch.status} after {timeout}s")
        time.sleep(0.5)


async def send_all(url: str, bodies: list[dict[str, Any]], concurrency: int) -> float:
    """Send every body with ``concurrency`` clients; seconds until the last answer."""
    queue = list(reversed(bodies))
    started = time.monotonic()

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            body = queue.pop()
            response = await client.post(CHAT, json=body)
            response.raise_for_status()

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return time.monotonic() - started


async def timed(url: str, bodies: list[dict[str, Any]]) -> tuple[list[float], list[str]]:
    """One request at a time: latencies and the cache header of each."""
    latencies, results = [], []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for body in bodies:
            started = time.monotonic()
            response = await client.post(CHAT, json=body)
            response.raise_for_status()
            latencies.append(time.monotonic() - started)
            results.append(response.headers.get("x-llmgate-cache", ""))
    return latencies, results


def measure(url: str, model: str, args: Any) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    users, seconds, tokens = (
        args.interactive_users,
        args.interactive_seconds,
        args.interactive_tokens,
    )
    lines = [sampled_body(model, i, args.batch_tokens) for i in range(args.batch_lines)]
    report: dict[str, Any] = {}

    print("[batch] interactive, idle", flush=True)
    idle = asyncio.run(interactive(url, model, users, seconds, tokens, None))
    report["interactive_idle"] = latency_stats(idle)

    print(f"[batch] interactive while a {len(lines)}-line batch runs", flush=True)
    batch_id = create_batch(client, lines)

    async def under_batch() -> list[float]:
        done = asyncio.Event()

        async def watch() -> None:
            # Polling the server's state: it has no push API to wait on.
            await asyncio.to_thread(wait_for_batch, client, batch_id)
            done.set()

        watcher = asyncio.create_task(watch())
        # Give the runner a moment to fill its slots before measuring.
        await asyncio.sleep(2)
        latencies = await interactive(url, model, users, seconds, tokens, done)
        watcher.cancel()
        return latencies

    busy = asyncio.run(under_batch())
    report["interactive_under_batch"] = latency_stats(busy)
    finished = wait_for_batch(client, batch_id)
    report["batch_under_load_status"] = finished.status
    if idle and busy:
        report["p50_ratio"] = (
            report["interactive_under_batch"]["p50_s"] / report["interactive_idle"]["p50_s"]
        )

    print("[batch] the batch alone on an idle pool", flush=True)
    started = time.monotonic()
    batch = wait_for_batch(client, create_batch(client, lines))
    batch_seconds = time.monotonic() - started
    counts = batch.request_counts
    report["batch_alone"] = {
        "lines": len(lines),
        "status": batch.status,
        "completed": counts.completed if counts else None,
        "failed": counts.failed if counts else None,
        "seconds": batch_seconds,
        "lines_per_s": len(lines) / batch_seconds,
    }
    print(f"[batch] the same requests sent interactively ({args.direct_concurrency} clients)")
    direct_seconds = asyncio.run(send_all(url, lines, args.direct_concurrency))
    report["interactive_same_requests"] = {
        "requests": len(lines),
        "concurrency": args.direct_concurrency,
        "seconds": direct_seconds,
        "requests_per_s": len(lines) / direct_seconds,
    }
    report["batch_throughput_ratio"] = (
        report["batch_alone"]["lines_per_s"] / report["interactive_same_requests"]["requests_per_s"]
    )

    print("[batch] cache: misses, then hits", flush=True)
    bodies = [greedy_body(model, i, tokens, "plain") for i in range(args.cache_requests)]
    miss_latencies, miss_results = asyncio.run(timed(url, bodies))
    hit_latencies, hit_results = asyncio.run(timed(url, bodies))
    report["cache_miss"] = latency_stats(miss_latencies) | {"headers": _count(miss_results)}
    report["cache_hit"] = latency_stats(hit_latencies) | {"headers": _count(hit_results)}

    print("[batch] precompute: a batch fills the cache, then the same requests", flush=True)
    precomputed = [greedy_body(model, i, tokens, "precomputed") for i in range(args.cache_requests)]
    batch = wait_for_batch(
        client, create_batch(client, precomputed, metadata={"llmgate_cache": "true"})
    )
    after_latencies, after_results = asyncio.run(timed(url, precomputed))
    report["precompute"] = latency_stats(after_latencies) | {
        "batch_status": batch.status,
        "headers": _count(after_results),
    }
    return report


def _count(results: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for result in results:
        out[result] = out.get(result, 0) + 1
    return out


def run(run_dir: Path, args: Any) -> dict[str, Any]:
    port, base = free_port(), free_port_range(1)
    argv = [
        *(sys.executable, "-m", "serve", "--port", str(port)),
        *("--worker-base-port", str(base), "--enforce-eager", "--cache", "memory"),
        *("--state-dir", str(run_dir / "state")),
    ]
    url = f"http://127.0.0.1:{port}"
    log_path = run_dir / "serve.log"
    with launched("llmgate serve", argv, log_path, env=dict(os.environ), cwd=ROOT) as proc:
        await_ready("llmgate serve", proc, log_path, f"{url}/ready", STARTUP_TIMEOUT_S)
        model = served_model(url)
        asyncio.run(send_all(url, [sampled_body(model, i, 8) for i in range(8)], 4))  # warm-up
        report = measure(url, model, args)
    report["parameters"] = {
        name: getattr(args, name)
        for name in (
            "interactive_users",
            "interactive_seconds",
            "interactive_tokens",
            "batch_lines",
            "batch_tokens",
            "direct_concurrency",
            "cache_requests",
        )
    }
    return report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def format_report(report: dict[str, Any]) -> str:
    idle, busy = report["interactive_idle"], report["interactive_under_batch"]
    alone, direct = report["batch_alone"], report["interactive_same_requests"]
    miss, hit, pre = report["cache_miss"], report["cache_hit"], report["precompute"]
    ratio = report.get("p50_ratio")
    lines = [
        "what                              requests   p50 ms   p99 ms",
        f"interactive, idle                 {idle['requests']:>8} {_ms(idle['p50_s']):>8} "
        f"{_ms(idle['p99_s']):>8}",
        f"interactive, batch running        {busy['requests']:>8} {_ms(busy['p50_s']):>8} "
        f"{_ms(busy['p99_s']):>8}   p50 x{ratio or 0:.2f} of idle (target <= 1.25)",
        f"cache miss                        {miss['requests']:>8} {_ms(miss['p50_s']):>8} "
        f"{_ms(miss['p99_s']):>8}   {miss['headers']}",
        f"cache hit                         {hit['requests']:>8} {_ms(hit['p50_s']):>8} "
        f"{_ms(hit['p99_s']):>8}   {hit['headers']}",
        f"after a precompute batch          {pre['requests']:>8} {_ms(pre['p50_s']):>8} "
        f"{_ms(pre['p99_s']):>8}   {pre['headers']}",
        "",
        f"batch alone: {alone['lines']} lines in {alone['seconds']:.1f} s = "
        f"{alone['lines_per_s']:.1f} lines/s ({alone['status']}); the same requests sent "
        f"interactively by {direct['concurrency']} clients: {direct['requests_per_s']:.1f}/s; "
        f"ratio {report['batch_throughput_ratio']:.2f} (target >= 0.8)",
    ]
    return "\n".join(lines)
