"""A rolling restart under load, measured: the ``rolling`` scenario of ``make loadtest``.

``llmgate serve --num-workers 2`` (the embedded model; eager with
``--enforce-eager``) takes ``--chat-users`` closed-loop clients, each
streaming completions of ``--chat-max-tokens`` tokens (``ignore_eos``), one
after another. For ``--duration`` seconds nothing happens: the baseline.
Then serve gets SIGHUP and restarts every worker in turn
(``serve.rolling``) while the same load goes on, until serve logs that the
roll is done. Reported for each phase: streams, client-visible errors (an
HTTP error, an error event, a stream that ends without ``[DONE]`` or with
fewer tokens than asked), latency and time to first token p50/p99; for the
roll, its length and, from the gateway's metrics, the streams moved to
another worker (by reason) and the tokens those workers computed again.

    make loadtest ARGS="--scenario rolling --enforce-eager"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.capacity import StreamResult, one_stream
from loadtest.percentiles import observed_percentile
from loadtest.procs import await_ready, healthy_workers, launched, served_model
from loadtest.report import ROOT, write_json
from shared.ports import free_port, free_port_range

STARTUP_TIMEOUT_S = 600.0
# Two engines restart one after the other: minutes on a CPU.
ROLL_TIMEOUT_S = 900.0
ROLL_DONE = "rolling restart done"


def moved(metrics_page: str) -> dict[str, float]:
    """The gateway's migrations by reason, and the tokens handed on (``tokens``)."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_page):
        for sample in family.samples:
            if sample.name == "llmgate_migrations_total":
                counts[sample.labels["reason"]] = sample.value
            elif sample.name == "llmgate_migrated_tokens_total":
                counts["tokens"] = sample.value
    return counts


def says(log_path: Path, since: int, text: str) -> bool:
    """Whether the log holds ``text`` past its first ``since`` bytes."""
    with log_path.open("rb") as log:
        log.seek(since)
        return text.encode() in log.read()


def failed(result: StreamResult, max_tokens: int) -> bool:
    """What a client would call an error: anything but a whole stream."""
    return (
        result.status != 200
        or result.error is not None
        or not result.done
        or result.tokens != max_tokens
    )


def phase_report(results: list[tuple[float, StreamResult]], max_tokens: int) -> dict[str, Any]:
    latencies = [r.seconds for _, r in results if not failed(r, max_tokens)]
    ttfts = [
        r.first_token_s
        for _, r in results
        if not failed(r, max_tokens) and r.first_token_s is not None
    ]
    errors = [r for _, r in results if failed(r, max_tokens)]

    def pct(values: list[float], q: float) -> float | None:
        return round(observed_percentile(values, q), 3) if values else None

    return {
        "streams": len(results),
        "errors": len(errors),
        "error_examples": [
            {"status": r.status, "error": r.error, "done": r.done, "tokens": r.tokens}
            for r in errors[:5]
        ],
        "error_kinds": dict(Counter(str(r.error or r.status)[:80] for r in errors)),
        "latency_p50_s": pct(latencies, 0.5),
        "latency_p99_s": pct(latencies, 0.99),
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p99_s": pct(ttfts, 0.99),
    }


async def load(
    url: str,
    model: str,
    users: int,
    max_tokens: int,
    stop: asyncio.Event,
) -> list[tuple[float, StreamResult]]:
    """Closed-loop streams until ``stop``; each with the time it started."""
    results: list[tuple[float, StreamResult]] = []
    counter = [0]
    open_now = [0]
    limits = httpx.Limits(max_connections=users * 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def user() -> None:
            while not stop.is_set():
                counter[0] += 1
                started = time.monotonic()
                result = await one_stream(client, model, max_tokens, counter[0], open_now)
                results.append((started, result))

        await asyncio.gather(*(user() for _ in range(users)))
    return results


async def measure(
    url: str, model: str, args: argparse.Namespace, proc: Any, log_path: Path
) -> dict[str, Any]:
    stop = asyncio.Event()
    loading = asyncio.create_task(load(url, model, args.chat_users, args.chat_max_tokens, stop))
    print(f"[rolling] {args.duration:.0f}s of steady load", flush=True)
    await asyncio.sleep(args.duration)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        before = moved((await client.get("/metrics")).text)
        rolled_at = time.monotonic()
        log_from = await asyncio.to_thread(lambda: log_path.stat().st_size)
        print("[rolling] SIGHUP: every worker restarts in turn", flush=True)
        proc.send_signal(signal.SIGHUP)
        while not await asyncio.to_thread(says, log_path, log_from, ROLL_DONE):
            if time.monotonic() - rolled_at > ROLL_TIMEOUT_S:
                stop.set()
                await loading
                raise RuntimeError(f"the roll did not finish in {ROLL_TIMEOUT_S:.0f}s")
            await asyncio.sleep(1)
        roll_s = time.monotonic() - rolled_at
        print(f"[rolling] done in {roll_s:.0f}s", flush=True)
        stop.set()
        results = await loading
        after = moved((await client.get("/metrics")).text)
    steady = [(t, r) for t, r in results if t < rolled_at]
    rolling = [(t, r) for t, r in results if rolled_at <= t < rolled_at + roll_s]
    return {
        "steady": phase_report(steady, args.chat_max_tokens),
        "rolling": phase_report(rolling, args.chat_max_tokens),
        "roll_s": round(roll_s, 1),
        "moved": {k: after.get(k, 0) - before.get(k, 0) for k in after},
    }


def run(run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    port, base = free_port(), free_port_range(2)
    argv = [
        *(sys.executable, "-m", "serve", "--num-workers", "2"),
        *("--port", str(port), "--worker-base-port", str(base)),
        *(("--enforce-eager",) if args.enforce_eager else ()),
    ]
    url = f"http://127.0.0.1:{port}"
    log_path = run_dir / "serve.log"
    with launched("llmgate serve", argv, log_path, env=dict(os.environ), cwd=ROOT) as proc:
        await_ready(
            "llmgate serve",
            proc,
            log_path,
            f"{url}/ready",
            STARTUP_TIMEOUT_S,
            check=healthy_workers(2),
        )
        model = args.model or served_model(url)
        report = asyncio.run(measure(url, model, args, proc, log_path))
    report |= {
        "users": args.chat_users,
        "max_tokens": args.chat_max_tokens,
        "steady_s": args.duration,
        "engine": "eager" if args.enforce_eager else "compiled",
    }
    write_json(run_dir / "summary.json", report)
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"rolling restart of 2 workers under {report['users']} streaming users "
        f"({report['max_tokens']} tokens each, {report['engine']}): the roll took "
        f"{report['roll_s']:.0f}s",
        "phase    streams errors  p50 s   p99 s  TTFT p50  TTFT p99",
    ]
    for name in ("steady", "rolling"):
        p = report[name]
        lines.append(
            f"{name:<8} {p['streams']:>7} {p['errors']:>6} {p['latency_p50_s'] or 0:>6.2f} "
            f"{p['latency_p99_s'] or 0:>7.2f} {p['ttft_p50_s'] or 0:>9.2f} "
            f"{p['ttft_p99_s'] or 0:>9.2f}"
        )
    moved = report["moved"]
    tokens = moved.pop("tokens", 0)
    lines.append(f"streams moved: {dict(moved) or 'none'}; tokens computed again: {tokens:.0f}")
    return "\n".join(lines)
