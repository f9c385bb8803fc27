"""Fair sharing between API keys, measured: the ``tenants`` scenario of ``make loadtest``.

``llmgate serve`` (one worker, the embedded model, eager) with two keys,
``flooder`` and ``trickle``, and ``--max-inflight-per-worker --tenant-slots``
(8), so that requests queue at the gateway (admission), where fair sharing
acts, rather than inside the engine; beside it, a lone gateway in front of
the same worker with ``--fair-share false``. Queued requests wait up to 900
s rather than the default 30 s, so every request completes.

Three phases, one after the other:

* ``alone``: the ``trickle`` key alone;
* ``fair``: the same while ``flooder`` keeps ``--flood-users`` (64) long
  requests (``--flood-tokens``, 128 tokens) in flight or queued, closed loop;
  fair sharing on;
* ``fifo``: the same against the gateway with fair sharing off.

The trickle is open loop: ``--trickle-requests`` (20) streamed chats of
``--trickle-tokens`` (16) tokens, one every ``--trickle-interval`` (1.5) s,
sent once the flood fills the queue (the gateway's queue depth, not a
sleep). Reports per phase the trickle's time to first token and latency
(p50, p99), its failures, and the flood's completed tokens per second over
the phase (what fair sharing costs the flooder); writes ``summary.json`` and
``summary.csv`` into the run's directory.

    make loadtest ARGS="--scenario tenants"
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.closed_loop import parse_sse_line
from loadtest.percentiles import percentile
from loadtest.procs import await_ready, healthy_workers, launched
from loadtest.report import ROOT, TextColumn, markdown_table, text_table, write_csv, write_json
from shared.ports import free_port, free_port_range

STARTUP_TIMEOUT_S = 600.0
QUEUE_TIMEOUT_S = "900"
FLOODER_KEY = "sk-llmgate-loadtest-flooder"
TRICKLE_KEY = "sk-llmgate-loadtest-trickle"
# The gateway's /metrics (its queue depth) takes an admin key.
OPERATOR_KEY = "sk-llmgate-loadtest-operator"
PHASES = ("alone", "fair", "fifo")


@dataclass
class Phase:
    """One phase's figures; times in milliseconds."""

    phase: str
    fair_share: bool
    flood_users: int
    trickle_ok: int
    trickle_failed: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    flood_tokens_per_s: float | None
    seconds: float


@dataclass
class _Trickled:
    start: float
    first: float | None = None
    end: float | None = None
    error: str | None = None


def keys_file(run_dir: Path) -> Path:
    path = run_dir / "keys.yaml"
    path.write_text(
        "keys:\n"
        f"  - name: flooder\n    key: {FLOODER_KEY}\n"
        f"  - name: trickle\n    key: {TRICKLE_KEY}\n"
        f"  - name: operator\n    key: {OPERATOR_KEY}\n    admin: true\n"
    )
    return path


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _queue_depth(client: httpx.AsyncClient) -> float:
    response = await client.get("/metrics", headers=_auth(OPERATOR_KEY))
    response.raise_for_status()  # else an empty page: a depth of 0 for ever
    text = response.text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmgate_queue_depth")
    )


async def _queue_reaches(client: httpx.AsyncClient, depth: float) -> None:
    """Until the gateway's queue holds ``depth`` requests (polled: it has no event)."""
    while True:
        if await _queue_depth(client) >= depth:
            return
        await asyncio.sleep(0.2)


async def _chat(client: httpx.AsyncClient, model: str, tokens: int, sample: _Trickled) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello to the team."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=_auth(TRICKLE_KEY)
        ) as response:
            if response.status_code != 200:
                await response.aread()
                sample.error = f"HTTP {response.status_code}"
                return
            async for line in response.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk is None or sample.first is not None:
                    continue
                choices = chunk.get("choices") or ()
                if any((c.get("delta") or {}).get("content") for c in choices):
                    sample.first = time.perf_counter()
    except httpx.HTTPError as exc:
        sample.error = type(exc).__name__
    finally:
        sample.end = time.perf_counter()


async def _flooder(
    client: httpx.AsyncClient, model: str, tokens: int, done: list[tuple[float, int]]
) -> None:
    """One closed-loop flooding user: a long request, then the next, until cancelled."""
    body = {
        "model": model,
        "prompt": "Write a long story about a lighthouse keeper.",
        "max_tokens": tokens,
        "ignore_eos": True,
    }
    while True:
        response = await client.post("/v1/completions", json=body, headers=_auth(FLOODER_KEY))
        if response.status_code == 200:
            done.append((time.perf_counter(), response.json()["usage"]["completion_tokens"]))
        else:
            await asyncio.sleep(0.5)  # refused (it should not be): do not spin


async def phase(url: str, model: str, name: str, fair: bool, args: Any) -> Phase:
    flood_users = 0 if name == "alone" else args.flood_users
    limits = httpx.Limits(max_connections=flood_users + args.trickle_requests + 8)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        done: list[tuple[float, int]] = []
        flood = [
            asyncio.create_task(_flooder(client, model, args.flood_tokens, done))
            for _ in range(flood_users)
        ]
        try:
            if flood_users:
                # The flood fills every slot and queues the rest: then the trickle.
                waiting = max(1, flood_users - args.tenant_slots)
                await _queue_reaches(client, waiting)
            started = time.perf_counter()
            samples: list[_Trickled] = []
            sent: list[asyncio.Task[None]] = []
            for i in range(args.trickle_requests):
                await asyncio.sleep(
                    max(0.0, started + i * args.trickle_interval - time.perf_counter())
                )
                sample = _Trickled(start=time.perf_counter())
                samples.append(sample)
                sent.append(asyncio.create_task(_chat(client, model, args.trickle_tokens, sample)))
            await asyncio.gather(*sent)
            ended = time.perf_counter()
        finally:
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
    ok = [s for s in samples if s.error is None and s.first is not None and s.end is not None]
    ttfts = [(s.first - s.start) * 1000 for s in ok if s.first is not None]
    latencies = [(s.end - s.start) * 1000 for s in ok if s.end is not None]
    seconds = ended - started
    flood_tokens = sum(tokens for at, tokens in done if started <= at <= ended)
    return Phase(
        phase=name,
        fair_share=fair,
        flood_users=flood_users,
        trickle_ok=len(ok),
        trickle_failed=len(samples) - len(ok),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        latency_p50_ms=percentile(latencies, 50),
        latency_p99_ms=percentile(latencies, 99),
        flood_tokens_per_s=flood_tokens / seconds if flood_users else None,
        seconds=seconds,
    )


def run(run_dir: Path, args: Any) -> dict[str, Any]:
    keys = keys_file(run_dir)
    port, base, lone_port = free_port(), free_port_range(1), free_port()
    common = [
        *("--api-keys-file", str(keys)),
        *("--max-inflight-per-worker", str(args.tenant_slots)),
        *("--queue-timeout", QUEUE_TIMEOUT_S),
    ]
    serve_argv = [
        *(sys.executable, "-m", "serve", "--port", str(port)),
        *("--worker-base-port", str(base), "--enforce-eager"),
        *common,
    ]
    lone_argv = [
        *(sys.executable, "-m", "gateway.main", "--port", str(lone_port)),
        *("--workers", f"tcp://127.0.0.1:{base}", "--fair-share", "false"),
        *common,
    ]
    fair_url, fifo_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{lone_port}"
    phases: list[Phase] = []
    with contextlib.ExitStack() as stack:
        serve_log, lone_log = run_dir / "serve.log", run_dir / "gateway-fifo.log"
        proc = stack.enter_context(launched("llmgate", serve_argv, serve_log, cwd=ROOT))
        check = healthy_workers(1)
        await_ready("llmgate", proc, serve_log, f"{fair_url}/ready", STARTUP_TIMEOUT_S, check)
        lone = stack.enter_context(
            launched("gateway fifo", lone_argv, lone_log, env=dict(os.environ), cwd=ROOT)
        )
        await_ready("gateway fifo", lone, lone_log, f"{fifo_url}/ready", 120.0, check)
        model = (
            args.model
            or httpx.get(f"{fair_url}/v1/models", headers=_auth(TRICKLE_KEY), timeout=30).json()[
                "data"
            ][0]["id"]
        )
        for url in (fair_url, fifo_url):  # warm-up, not counted
            httpx.post(
                f"{url}/v1/completions",
                json={"model": model, "prompt": "Hi", "max_tokens": 4},
                headers=_auth(TRICKLE_KEY),
                timeout=300,
            )
        for name in PHASES:
            fair = name != "fifo"
            url = fifo_url if name == "fifo" else fair_url
            print(f"[tenants] {name}: fair sharing {'on' if fair else 'off'}", flush=True)
            phases.append(asyncio.run(phase(url, model, name, fair, args)))
            print(f"[tenants] {name}: {_line(phases[-1])}", flush=True)
    report = {
        "model": model,
        "slots": args.tenant_slots,
        "flood_users": args.flood_users,
        "flood_tokens": args.flood_tokens,
        "trickle_requests": args.trickle_requests,
        "trickle_interval_s": args.trickle_interval,
        "trickle_tokens": args.trickle_tokens,
        "phases": [asdict(p) for p in phases],
    }
    write_csv(run_dir / "summary.csv", phases)
    write_json(run_dir / "summary.json", report)
    return report


def _line(p: Phase) -> str:
    return (
        f"TTFT p50 {_ms(p.ttft_p50_ms)} ms, p99 {_ms(p.ttft_p99_ms)} ms; "
        f"latency p50 {_ms(p.latency_p50_ms)} ms; {p.trickle_failed} failed"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


COLUMNS: tuple[TextColumn, ...] = (
    ("phase", "phase", "{:<6}", 6),
    ("flood_users", "flood", "{:>5}", 5),
    ("trickle_ok", "ok", "{:>4}", 4),
    ("trickle_failed", "failed", "{:>6}", 6),
    ("ttft_p50_ms", "TTFT p50 ms", "{:>11.0f}", 11),
    ("ttft_p99_ms", "TTFT p99 ms", "{:>11.0f}", 11),
    ("latency_p50_ms", "lat p50 ms", "{:>10.0f}", 10),
    ("latency_p99_ms", "lat p99 ms", "{:>10.0f}", 10),
    ("flood_tokens_per_s", "flood tok/s", "{:>11.1f}", 11),
)


def format_report(report: dict[str, Any]) -> str:
    phases = [Phase(**p) for p in report["phases"]]
    title = (
        f"tenants: trickle of {report['trickle_requests']} chats x {report['trickle_tokens']} "
        f"tokens (one per {report['trickle_interval_s']:g}s) beside a flood of "
        f"{report['flood_users']} x {report['flood_tokens']}-token requests, "
        f"{report['slots']} slots"
    )
    rows = [
        [
            p.phase,
            "on" if p.fair_share else "off",
            str(p.flood_users),
            _ms(p.ttft_p50_ms),
            _ms(p.ttft_p99_ms),
            _ms(p.latency_p50_ms),
            _ms(p.latency_p99_ms),
            f"{p.trickle_failed}/{p.trickle_ok + p.trickle_failed}",
            "-" if p.flood_tokens_per_s is None else f"{p.flood_tokens_per_s:.1f}",
        ]
        for p in phases
    ]
    header = [
        "phase",
        "fair share",
        "flood users",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "latency p50 ms",
        "latency p99 ms",
        "failed",
        "flood tok/s",
    ]
    return "\n".join([title, text_table(COLUMNS, phases), "", markdown_table(header, rows)])
