"""Spill-over, measured: the ``spillover`` scenario of ``make loadtest``.

``llmgate serve --config`` with the two-pools example (docs/models.md) (tier 1: the
embedded model in bfloat16 with 4 slots on core 0; tier 2: float32 on core 1,
the first's substitute), twice: as the file says (``spill_after: 0``), and
with spill-over off (``spill_after`` removed, so every request waits for its
own pool). Each time, ``--bursts`` bursts of ``--burst`` non-streaming
requests for ``fast`` (the tier-1 pool), sent at once, ``--burst-tokens``
tokens each (``ignore_eos``), queued requests waiting up to 900 s rather than
the default 30 s (so both modes complete every request). Reports per mode
the latency of every request (mean, p50, p99), the burst's wall time, how
many each pool answered, and failures; writes ``summary.json`` into the
run's directory.

    make loadtest ARGS="--scenario spillover"
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import msgspec

from loadtest.percentiles import observed_percentile
from loadtest.procs import await_ready, healthy_workers, launched
from loadtest.report import ROOT, write_json
from shared import config as pools_config
from shared.ports import free_port, free_port_range

EXAMPLE = ROOT / "examples" / "two-pools.yaml"
STARTUP_TIMEOUT_S = 600.0
# Queued requests wait for a slot instead of a 429 after the default 30 s:
# the scenario compares latencies, and without spill-over the burst's last
# requests queue for longer than that.
QUEUE_TIMEOUT_S = "900"


def without_spill(config: pools_config.Config) -> pools_config.Config:
    pools = [msgspec.structs.replace(p, spill_after=None) for p in config.pools]
    return msgspec.structs.replace(config, pools=pools)


async def burst(url: str, model: str, count: int, tokens: int) -> list[dict[str, Any]]:
    async def one(i: int, client: httpx.AsyncClient) -> dict[str, Any]:
        body = {
            "model": model,
            "prompt": f"Request {i}: count from one to a hundred.",
            "max_tokens": tokens,
            "ignore_eos": True,
        }
        started = time.monotonic()
        try:
            response = await client.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            return {"status": 0, "error": repr(exc), "seconds": time.monotonic() - started}
        return {
            "status": response.status_code,
            "seconds": time.monotonic() - started,
            "pool": response.headers.get("x-llmgate-pool", ""),
            "tokens": response.json().get("usage", {}).get("completion_tokens", 0)
            if response.status_code == 200
            else 0,
        }

    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        return await asyncio.gather(*(one(i, client) for i in range(count)))


def measure(
    mode: str, config_path: Path, run_dir: Path, bursts: int, size: int, tokens: int
) -> dict[str, Any]:
    port, base = free_port(), free_port_range(2)
    argv = [
        *(sys.executable, "-m", "serve", "--config", str(config_path)),
        *("--port", str(port), "--worker-base-port", str(base), "--enforce-eager"),
    ]
    url = f"http://127.0.0.1:{port}"
    log_path = run_dir / f"serve-{mode}.log"
    env = {**os.environ, "LLMGATE_QUEUE_TIMEOUT": QUEUE_TIMEOUT_S}
    with launched(f"llmgate {mode}", argv, log_path, env=env, cwd=ROOT) as proc:
        await_ready(
            f"llmgate {mode}",
            proc,
            log_path,
            f"{url}/ready",
            STARTUP_TIMEOUT_S,
            check=healthy_workers(2),
        )
        asyncio.run(burst(url, "fast", 2, 4))  # warm-up, not counted
        asyncio.run(burst(url, "accurate", 2, 4))
        results: list[dict[str, Any]] = []
        walls = []
        for index in range(bursts):
            started = time.monotonic()
            results += asyncio.run(burst(url, "fast", size, tokens))
            walls.append(time.monotonic() - started)
            print(f"  [{mode}] burst {index + 1}: {walls[-1]:.1f}s", flush=True)
    ok = [r for r in results if r["status"] == 200 and r["tokens"] == tokens]
    latencies = [r["seconds"] for r in ok]
    return {
        "mode": mode,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "statuses": dict(Counter(str(r["status"]) for r in results)),
        "by_pool": dict(Counter(r.get("pool", "") for r in ok)),
        "latency_mean_s": statistics.fmean(latencies) if latencies else None,
        "latency_p50_s": observed_percentile(latencies, 0.5) if latencies else None,
        "latency_p99_s": observed_percentile(latencies, 0.99) if latencies else None,
        "burst_wall_s": walls,
    }


def run(run_dir: Path, bursts: int, size: int, tokens: int) -> dict[str, Any]:
    config = pools_config.load(EXAMPLE)
    off = run_dir / "two-pools-no-spill.yaml"
    off.write_text(pools_config.to_yaml(without_spill(config)))
    modes = []
    for mode, path in (("spill", EXAMPLE), ("no-spill", off)):
        print(f"[spillover] {mode}: {bursts} bursts of {size} x {tokens} tokens", flush=True)
        modes.append(measure(mode, path, run_dir, bursts, size, tokens))
    report = {"config": str(EXAMPLE.relative_to(ROOT)), "burst": size, "tokens": tokens}
    report["modes"] = modes
    write_json(run_dir / "summary.json", report)
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"spill-over: bursts of {report['burst']} requests x {report['tokens']} tokens "
        f"for `fast` ({report['config']})",
        "mode      completed failed  mean s   p50 s   p99 s  by pool",
    ]
    for m in report["modes"]:
        lines.append(
            f"{m['mode']:<9} {m['completed']:>9} {m['failed']:>6} "
            f"{m['latency_mean_s'] or 0:>7.2f} {m['latency_p50_s'] or 0:>7.2f} "
            f"{m['latency_p99_s'] or 0:>7.2f}  {m['by_pool']}"
        )
    return "\n".join(lines)
