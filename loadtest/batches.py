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

With ``--gateways N`` (N > 1), N gateways share the state store (the
serve's SQLite state directory, or ``--state-db``) and run the batch
together: besides the serve's gateway, N-1 lone gateways (``python -m
gateway.main --cache memory``) in front of the serve's worker. The order
changes so that one run measures both: phases 4 and 3 first, on the serve's
gateway alone (the batch's lines per second with 1 gateway); then the extra
gateways start, the same batch alone runs on all N (lines per second with N
gateways, and how many lines each ran, from its
``llmgate_batch_lines_total{status="completed"}``); then phases 1 and 2, the
interactive users' requests spread round-robin over the N gateways, the
batch created through the first.

Writes ``summary.json`` into the run's directory and prints a table.

    make loadtest ARGS="--scenario batch"
    make loadtest ARGS="--scenario batch --gateways 2"
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from loadtest.percentiles import observed_percentile
from loadtest.procs import await_ready, healthy_workers, launched, served_model
from loadtest.report import ROOT
from shared.ports import free_port, free_port_range

STARTUP_TIMEOUT_S = 600.0
# A lone gateway in front of a worker that is already up starts in seconds.
GATEWAY_TIMEOUT_S = 120.0
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
    urls: Sequence[str],
    model: str,
    users: int,
    seconds: float,
    tokens: int,
    until: asyncio.Event | None,
) -> list[float]:
    """Closed-loop users for ``seconds`` (or until ``until`` is set): each request's latency.

    Requests go to the gateways ``urls`` in turn (round-robin over all users' requests).
    """
    latencies: list[float] = []
    stop_at = time.monotonic() + seconds
    turn = itertools.cycle(urls)

    async def user(index: int, client: httpx.AsyncClient) -> None:
        i = index
        while time.monotonic() < stop_at and not (until is not None and until.is_set()):
            started = time.monotonic()
            response = await client.post(next(turn) + CHAT, json=sampled_body(model, i, tokens))
            if response.status_code == 200:
                latencies.append(time.monotonic() - started)
            i += users

    async with httpx.AsyncClient(timeout=600) as client:
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


def completed_lines(metrics_page: str) -> int:
    """Batch lines a gateway completed, from its ``/metrics`` page (every label set summed)."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_page):
        for sample in family.samples:
            if (
                sample.name == "llmgate_batch_lines_total"
                and sample.labels.get("status") == "completed"
            ):
                total += sample.value
    return round(total)


def lines_by_gateway(urls: Sequence[str]) -> list[int]:
    """Each gateway's ``llmgate_batch_lines_total{status="completed"}`` now."""
    return [completed_lines(httpx.get(f"{url}/metrics", timeout=30).text) for url in urls]


def _openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)


def batch_lines(model: str, args: Any) -> list[dict[str, Any]]:
    return [sampled_body(model, i, args.batch_tokens) for i in range(args.batch_lines)]


def interactive_phases(urls: Sequence[str], model: str, args: Any) -> dict[str, Any]:
    """Phases 1 and 2: interactive latency idle, then while a batch (made on ``urls[0]``) runs."""
    client = _openai_client(urls[0])
    users, seconds, tokens = (
        args.interactive_users,
        args.interactive_seconds,
        args.interactive_tokens,
    )
    lines = batch_lines(model, args)
    report: dict[str, Any] = {}
    where = f" on {len(urls)} gateways" if len(urls) > 1 else ""

    print(f"[batch] interactive, idle{where}", flush=True)
    idle = asyncio.run(interactive(urls, model, users, seconds, tokens, None))
    report["interactive_idle"] = latency_stats(idle)

    print(f"[batch] interactive while a {len(lines)}-line batch runs{where}", flush=True)
    counted = lines_by_gateway(urls)
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
        latencies = await interactive(urls, model, users, seconds, tokens, done)
        watcher.cancel()
        return latencies

    busy = asyncio.run(under_batch())
    report["interactive_under_batch"] = latency_stats(busy)
    finished = wait_for_batch(client, batch_id)
    report["batch_under_load_status"] = finished.status
    report["batch_under_load_lines_by_gateway"] = [
        after - before for before, after in zip(counted, lines_by_gateway(urls), strict=True)
    ]
    if idle and busy:
        report["p50_ratio"] = (
            report["interactive_under_batch"]["p50_s"] / report["interactive_idle"]["p50_s"]
        )
    return report


def batch_alone(urls: Sequence[str], model: str, args: Any) -> dict[str, Any]:
    """Phase 3's batch, nothing else running, on the gateways ``urls`` (created on the first)."""
    client = _openai_client(urls[0])
    lines = batch_lines(model, args)
    count = f"{len(urls)} gateways" if len(urls) > 1 else "1 gateway"
    print(f"[batch] the batch alone on an idle pool ({count})", flush=True)
    counted = lines_by_gateway(urls)
    started = time.monotonic()
    batch = wait_for_batch(client, create_batch(client, lines))
    batch_seconds = time.monotonic() - started
    counts = batch.request_counts
    return {
        "lines": len(lines),
        "gateways": len(urls),
        "status": batch.status,
        "completed": counts.completed if counts else None,
        "failed": counts.failed if counts else None,
        "seconds": batch_seconds,
        "lines_per_s": len(lines) / batch_seconds,
        "lines_by_gateway": [
            after - before for before, after in zip(counted, lines_by_gateway(urls), strict=True)
        ],
    }


def direct_phase(url: str, model: str, args: Any) -> dict[str, Any]:
    """Phase 3's requests sent interactively by ``--direct-concurrency`` clients."""
    lines = batch_lines(model, args)
    print(f"[batch] the same requests sent interactively ({args.direct_concurrency} clients)")
    direct_seconds = asyncio.run(send_all(url, lines, args.direct_concurrency))
    return {
        "requests": len(lines),
        "concurrency": args.direct_concurrency,
        "seconds": direct_seconds,
        "requests_per_s": len(lines) / direct_seconds,
    }


def cache_phases(url: str, model: str, args: Any) -> dict[str, Any]:
    """Phase 4 on one gateway (its cache is in its memory): misses, hits, precompute."""
    client = _openai_client(url)
    tokens = args.interactive_tokens
    report: dict[str, Any] = {}
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


def measure(url: str, model: str, args: Any) -> dict[str, Any]:
    """One gateway: phases 1 to 4 in order."""
    report = interactive_phases([url], model, args)
    report["batch_alone"] = batch_alone([url], model, args)
    report["interactive_same_requests"] = direct_phase(url, model, args)
    report["batch_throughput_ratio"] = (
        report["batch_alone"]["lines_per_s"] / report["interactive_same_requests"]["requests_per_s"]
    )
    return report | cache_phases(url, model, args)


def _count(results: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for result in results:
        out[result] = out.get(result, 0) + 1
    return out


def gateway_argv(port: int, worker: str, run_dir: Path, state_db: str) -> list[str]:
    """A lone gateway in front of ``worker``, on the state store the serve's gateway uses."""
    store = ("--state-db", state_db) if state_db else ("--state-dir", str(run_dir / "state"))
    return [
        *(sys.executable, "-m", "gateway.main", "--port", str(port)),
        *("--workers", worker, "--cache", "memory", *store),
    ]


def measure_spread(
    stack: contextlib.ExitStack, run_dir: Path, url: str, worker: str, model: str, args: Any
) -> dict[str, Any]:
    """``--gateways N``: phases 4 and 3 on the serve's gateway alone, then N-1 more
    gateways start (their processes stopped by ``stack``), the batch alone on all N,
    phases 1 and 2 on all N."""
    report = cache_phases(url, model, args)
    report["interactive_same_requests"] = direct_phase(url, model, args)
    report["batch_alone"] = batch_alone([url], model, args)
    report["batch_throughput_ratio"] = (
        report["batch_alone"]["lines_per_s"] / report["interactive_same_requests"]["requests_per_s"]
    )
    urls = [url]
    for index in range(1, args.gateways):
        port, name = free_port(), f"gateway-{index + 1}"
        log_path = run_dir / f"{name}.log"
        argv = gateway_argv(port, worker, run_dir, args.state_db)
        proc = stack.enter_context(launched(name, argv, log_path, env=dict(os.environ), cwd=ROOT))
        urls.append(f"http://127.0.0.1:{port}")
        await_ready(
            name, proc, log_path, f"{urls[-1]}/ready", GATEWAY_TIMEOUT_S, healthy_workers(1)
        )
    for extra in urls[1:]:  # each new gateway's first requests are not counted
        asyncio.run(send_all(extra, [sampled_body(model, i, 8) for i in range(4)], 4))
    report["batch_alone_spread"] = batch_alone(urls, model, args)
    return report | interactive_phases(urls, model, args)


def run(run_dir: Path, args: Any) -> dict[str, Any]:
    port, base = free_port(), free_port_range(1)
    argv = [
        *(sys.executable, "-m", "serve", "--port", str(port)),
        *("--worker-base-port", str(base), "--enforce-eager", "--cache", "memory"),
        *("--state-dir", str(run_dir / "state")),
        *(("--state-db", args.state_db) if args.state_db else ()),
    ]
    url = f"http://127.0.0.1:{port}"
    log_path = run_dir / "serve.log"
    with contextlib.ExitStack() as stack:
        proc = stack.enter_context(
            launched("llmgate serve", argv, log_path, env=dict(os.environ), cwd=ROOT)
        )
        await_ready("llmgate serve", proc, log_path, f"{url}/ready", STARTUP_TIMEOUT_S)
        model = served_model(url)
        asyncio.run(send_all(url, [sampled_body(model, i, 8) for i in range(8)], 4))  # warm-up
        if args.gateways > 1:
            worker = f"tcp://127.0.0.1:{base}"
            report = measure_spread(stack, run_dir, url, worker, model, args)
        else:
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
            "gateways",
        )
    }
    # The URL may hold a password: only which store it was.
    report["parameters"]["state_store"] = "postgresql (--state-db)" if args.state_db else "sqlite"
    return report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _spread(counts: Sequence[int]) -> str:
    return " + ".join(str(count) for count in counts)


def format_report(report: dict[str, Any]) -> str:
    idle, busy = report["interactive_idle"], report["interactive_under_batch"]
    alone, direct = report["batch_alone"], report["interactive_same_requests"]
    miss, hit, pre = report["cache_miss"], report["cache_hit"], report["precompute"]
    ratio = report.get("p50_ratio")
    spread = report.get("batch_alone_spread")
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
    if spread:
        n = spread["gateways"]
        lines += [
            "",
            f"interactive rows: requests round-robin over {n} gateways (their batch too); "
            "the other rows: the first gateway alone",
            "",
            "gateways   lines   seconds   lines/s   lines per gateway",
            f"{1:>8} {alone['lines']:>7} {alone['seconds']:>9.1f} {alone['lines_per_s']:>9.2f}"
            f"   {_spread(alone.get('lines_by_gateway', [alone['lines']]))}",
            f"{n:>8} {spread['lines']:>7} {spread['seconds']:>9.1f} "
            f"{spread['lines_per_s']:>9.2f}   {_spread(spread['lines_by_gateway'])}"
            f" ({spread['status']}; x{spread['lines_per_s'] / alone['lines_per_s']:.2f}"
            " of 1 gateway)",
            f"batch under the interactive load, lines per gateway: "
            f"{_spread(report.get('batch_under_load_lines_by_gateway', []))}",
        ]
    return "\n".join(lines)
