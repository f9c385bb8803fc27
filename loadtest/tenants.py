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
  streamed requests (``--flood-tokens``, 128 tokens, x 0.5-1.5) in flight
  or queued, closed loop; fair sharing on;
* ``fifo``: the same against the gateway with fair sharing off.

The trickle is open loop: ``--trickle-requests`` (20) streamed chats of
``--trickle-tokens`` (16) tokens, one every ``--trickle-interval`` (1.5) s,
sent once the flood fills the queue (the gateway's queue depth, not a
sleep) and has run through its slots twice. Reports per phase the
trickle's time to first token and latency (p50, p99), its failures, and
the tokens per second streamed over the phase, the flood's and all (what
fair sharing costs the flooder); writes ``summary.json`` and
``summary.csv`` into the run's directory.

With ``--gateways N`` (N > 1) the flood and the trickle go round-robin
over N lone gateways in front of one worker whose engine runs
``--tenant-slots`` requests at once (``--max-num-seqs``); each gateway
admits as many, so the engine's own queue holds what the others sent.
Phases: ``alone``, then the flood with ``global`` fair sharing (the N
gateways count in one Redis, ``--limits``, and rank requests in the
engine's queue), ``local`` (each gateway on its own, no ``--limits``) and
``fifo`` (fair sharing off).

    make loadtest ARGS="--scenario tenants"
    make loadtest ARGS="--scenario tenants --gateways 2"
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.closed_loop import parse_sse_line
from loadtest.percentiles import percentile
from loadtest.procs import await_ready, healthy_workers, launched, start_redis
from loadtest.report import ROOT, TextColumn, markdown_table, text_table, write_csv, write_json
from shared.ports import free_port, free_port_range

STARTUP_TIMEOUT_S = 600.0
QUEUE_TIMEOUT_S = "900"
FLOODER_KEY = "sk-llmgate-loadtest-flooder"
TRICKLE_KEY = "sk-llmgate-loadtest-trickle"
# The gateway's /metrics (its queue depth) takes an admin key.
OPERATOR_KEY = "sk-llmgate-loadtest-operator"
PHASES = ("alone", "fair", "fifo")
# With --gateways N: fair sharing over every gateway, per gateway, and off.
SHARED_PHASES = ("alone", "global", "local", "fifo")


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
    # The flood's and the trickle's: what the engine made for both.
    total_tokens_per_s: float | None = None


@dataclass
class _Trickled:
    start: float
    first: float | None = None
    end: float | None = None
    error: str | None = None
    # When each of its tokens came.
    tokens: list[float] = field(default_factory=list)


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


async def _queue_depth(clients: list[httpx.AsyncClient]) -> float:
    return sum([await _one_queue_depth(client) for client in clients])


async def _one_queue_depth(client: httpx.AsyncClient) -> float:
    response = await client.get("/metrics", headers=_auth(OPERATOR_KEY))
    response.raise_for_status()  # else an empty page: a depth of 0 for ever
    text = response.text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmgate_queue_depth")
    )


async def _queue_reaches(clients: list[httpx.AsyncClient], depth: float) -> None:
    """Until the gateways' queues hold ``depth`` requests (polled: they have no event)."""
    while True:
        if await _queue_depth(clients) >= depth:
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
                if chunk is None:
                    continue
                choices = chunk.get("choices") or ()
                if any((c.get("delta") or {}).get("content") for c in choices):
                    sample.tokens.append(time.perf_counter())
                    if sample.first is None:
                        sample.first = sample.tokens[-1]
    except httpx.HTTPError as exc:
        sample.error = type(exc).__name__
    finally:
        sample.end = time.perf_counter()


@dataclass
class _Flood:
    """What the flood made: when each token came, and how many requests ended
    (``settled`` once ``settle_after`` have: its first requests, sent together,
    no longer end together)."""

    settle_after: int
    tokens: list[float] = field(default_factory=list)
    ended: int = 0
    settled: asyncio.Event = field(default_factory=asyncio.Event)


async def _flooder(
    client: httpx.AsyncClient, model: str, tokens: int, flood: _Flood, seed: int
) -> None:
    """One closed-loop flooding user: a long streamed request, then the next, until
    cancelled. Each asks for ``tokens`` x 0.5-1.5 (seeded): equal lengths would
    start and end together, in waves, and every other request would wait for
    the next wave. Each token it receives is counted when it comes, so the
    flood's throughput over a phase counts the tokens made in it, not the
    requests that happened to end in it (each holds seconds of tokens)."""
    rng = random.Random(seed)
    while True:
        body = {
            "model": model,
            "prompt": "Write a long story about a lighthouse keeper.",
            "max_tokens": max(1, round(tokens * rng.uniform(0.5, 1.5))),
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream(
            "POST", "/v1/completions", json=body, headers=_auth(FLOODER_KEY)
        ) as response:
            if response.status_code != 200:
                await response.aread()
                await asyncio.sleep(0.5)  # refused (it should not be): do not spin
                continue
            async for line in response.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk is not None and any(c.get("text") for c in chunk.get("choices") or ()):
                    flood.tokens.append(time.perf_counter())
        flood.ended += 1
        if flood.ended >= flood.settle_after:
            flood.settled.set()


async def phase(urls: list[str], model: str, name: str, fair: bool, args: Any) -> Phase:
    """One phase against the gateways ``urls``: every user and every trickled
    chat goes to the next of them in turn."""
    flood_users = 0 if name == "alone" else args.flood_users
    limits = httpx.Limits(max_connections=flood_users + args.trickle_requests + 8)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, timeout=900, limits=limits)
            )
            for url in urls
        ]
        made = _Flood(settle_after=2 * args.tenant_slots * len(clients))
        flood = [
            asyncio.create_task(
                _flooder(clients[i % len(clients)], model, args.flood_tokens, made, seed=i)
            )
            for i in range(flood_users)
        ]
        try:
            if flood_users:
                # The flood fills every slot and queues the rest, and runs
                # through its slots twice: then the trickle.
                waiting = max(1, flood_users - args.tenant_slots * len(clients))
                await _queue_reaches(clients, waiting)
                await made.settled.wait()
            started = time.perf_counter()
            samples: list[_Trickled] = []
            sent: list[asyncio.Task[None]] = []
            for i in range(args.trickle_requests):
                await asyncio.sleep(
                    max(0.0, started + i * args.trickle_interval - time.perf_counter())
                )
                sample = _Trickled(start=time.perf_counter())
                samples.append(sample)
                client = clients[i % len(clients)]
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
    flood_tokens = sum(1 for at in made.tokens if started <= at <= ended)
    trickle_tokens = sum(1 for s in samples for at in s.tokens if started <= at <= ended)
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
        total_tokens_per_s=(flood_tokens + trickle_tokens) / seconds,
        seconds=seconds,
    )


def run(run_dir: Path, args: Any) -> dict[str, Any]:
    if args.gateways > 1:
        return run_shared(run_dir, args)
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
        model = args.model or _model(fair_url)
        for url in (fair_url, fifo_url):
            _warm_up(url, model)
        for name in PHASES:
            fair = name != "fifo"
            url = fifo_url if name == "fifo" else fair_url
            print(f"[tenants] {name}: fair sharing {'on' if fair else 'off'}", flush=True)
            phases.append(asyncio.run(phase([url], model, name, fair, args)))
            print(f"[tenants] {name}: {_line(phases[-1])}", flush=True)
    return _report(run_dir, model, 1, phases, args)


def run_shared(run_dir: Path, args: Any) -> dict[str, Any]:
    """``--gateways N``: N gateways for each of fair sharing over all of them
    (Redis), per gateway, and off, in front of one worker of ``--tenant-slots``."""
    keys = keys_file(run_dir)
    port, base = free_port(), free_port_range(1)
    phases: list[Phase] = []
    with contextlib.ExitStack() as stack:
        redis = start_redis(run_dir, stack)
        serve_argv = [
            *(sys.executable, "-m", "serve", "--port", str(port)),
            *("--worker-base-port", str(base), "--enforce-eager"),
            # Flags serve does not know go to the worker: its engine's slots.
            *("--max-num-seqs", str(args.tenant_slots)),
        ]
        serve_log = run_dir / "serve.log"
        proc = stack.enter_context(launched("llmgate", serve_argv, serve_log, cwd=ROOT))
        check = healthy_workers(1)
        await_ready("llmgate", proc, serve_log, f"http://127.0.0.1:{port}/ready", 600.0, check)
        common = [
            *("--workers", f"tcp://127.0.0.1:{base}", "--api-keys-file", str(keys)),
            *("--queue-timeout", QUEUE_TIMEOUT_S),
        ]
        modes = {
            "global": ["--limits", redis],
            "local": [],
            "fifo": ["--fair-share", "false"],
        }
        urls: dict[str, list[str]] = {}
        for mode, flags in modes.items():
            for index in range(args.gateways):
                gateway_port = free_port()
                argv = [
                    *(sys.executable, "-m", "gateway.main", "--port", str(gateway_port)),
                    *common,
                    *flags,
                ]
                log = run_dir / f"gateway-{mode}-{index}.log"
                gateway = stack.enter_context(
                    launched(f"gateway {mode}", argv, log, env=dict(os.environ), cwd=ROOT)
                )
                url = f"http://127.0.0.1:{gateway_port}"
                await_ready(f"gateway {mode}", gateway, log, f"{url}/ready", 120.0, check)
                urls.setdefault(mode, []).append(url)
        model = args.model or _model(urls["global"][0])
        for url in [u for mode in modes for u in urls[mode]]:
            _warm_up(url, model)
        for name in SHARED_PHASES:
            mode = "global" if name == "alone" else name
            print(f"[tenants] {name}: {args.gateways} gateways", flush=True)
            phases.append(asyncio.run(phase(urls[mode], model, name, name != "fifo", args)))
            print(f"[tenants] {name}: {_line(phases[-1])}", flush=True)
    return _report(run_dir, model, args.gateways, phases, args)


def _model(url: str) -> str:
    answer = httpx.get(f"{url}/v1/models", headers=_auth(TRICKLE_KEY), timeout=30)
    return str(answer.json()["data"][0]["id"])


def _warm_up(url: str, model: str) -> None:
    """One request, not counted."""
    httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": "Hi", "max_tokens": 4},
        headers=_auth(TRICKLE_KEY),
        timeout=300,
    )


def _report(
    run_dir: Path, model: str, gateways: int, phases: list[Phase], args: Any
) -> dict[str, Any]:
    report = {
        "model": model,
        "gateways": gateways,
        "slots": args.tenant_slots,
        "flood_users": args.flood_users,
        "flood_tokens": args.flood_tokens,
        "trickle_requests": args.trickle_requests,
        "trickle_interval_s": args.trickle_interval,
        "trickle_tokens": args.trickle_tokens,
        "phases": [asdict(p) for p in phases],
    }
    by_name = {p.phase: p for p in phases}
    if {"global", "local", "fifo"} <= by_name.keys():
        # What the targets read: the trickle's TTFT with fair sharing
        # over every gateway against per gateway, and the flood's throughput
        # against first come, first served.
        report["ttft_p50_global_over_local"] = _ratio(
            by_name["global"].ttft_p50_ms, by_name["local"].ttft_p50_ms
        )
        report["flood_global_over_fifo"] = _ratio(
            by_name["global"].flood_tokens_per_s, by_name["fifo"].flood_tokens_per_s
        )
        # The flood gives the trickle the slots fair sharing owes it (under
        # first come, first served the trickle waits past most of the phase):
        # what the engine made for both is what fair sharing may cost.
        report["total_global_over_fifo"] = _ratio(
            by_name["global"].total_tokens_per_s, by_name["fifo"].total_tokens_per_s
        )
    write_csv(run_dir / "summary.csv", phases)
    write_json(run_dir / "summary.json", report)
    return report


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return None if top is None or not bottom else round(top / bottom, 3)


def _line(p: Phase) -> str:
    return (
        f"TTFT p50 {_ms(p.ttft_p50_ms)} ms, p99 {_ms(p.ttft_p99_ms)} ms; "
        f"latency p50 {_ms(p.latency_p50_ms)} ms; {p.trickle_failed} failed"
    )


def _fairness(p: Phase, gateways: int) -> str:
    if not p.fair_share:
        return "off"
    if gateways == 1:
        return "on"
    return "per gateway" if p.phase == "local" else "over all gateways"


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
    ("total_tokens_per_s", "all tok/s", "{:>9.1f}", 9),
)


def format_report(report: dict[str, Any]) -> str:
    phases = [Phase(**p) for p in report["phases"]]
    title = (
        f"tenants: trickle of {report['trickle_requests']} chats x {report['trickle_tokens']} "
        f"tokens (one per {report['trickle_interval_s']:g}s) beside a flood of "
        f"{report['flood_users']} x {report['flood_tokens']}-token requests, "
        f"{report['slots']} slots"
        + (f", {report['gateways']} gateways" if report.get("gateways", 1) > 1 else "")
    )
    rows = [
        [
            p.phase,
            _fairness(p, report.get("gateways", 1)),
            str(p.flood_users),
            _ms(p.ttft_p50_ms),
            _ms(p.ttft_p99_ms),
            _ms(p.latency_p50_ms),
            _ms(p.latency_p99_ms),
            f"{p.trickle_failed}/{p.trickle_ok + p.trickle_failed}",
            "-" if p.flood_tokens_per_s is None else f"{p.flood_tokens_per_s:.1f}",
            "-" if p.total_tokens_per_s is None else f"{p.total_tokens_per_s:.1f}",
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
        "all tok/s",
    ]
    lines = [title, text_table(COLUMNS, phases), "", markdown_table(header, rows)]
    if report.get("ttft_p50_global_over_local") is not None:
        lines.append(
            f"\ntrickle TTFT p50, over all gateways / per gateway: "
            f"{report['ttft_p50_global_over_local']}; flood tokens/s, over all gateways / "
            f"first come first served: {report.get('flood_global_over_fifo')} "
            f"(flood and trickle: {report.get('total_global_over_fifo')})"
        )
    return "\n".join(lines)
