"""``make bench-scaling``: does one gateway keep up with 1, 2, 4, 8 workers?

The workers are FAKE engines (``loadtest.fake_engine``, a benchmark double:
the real worker loop, no model) that emit one token per step at a fixed
rate, so what one worker can deliver is known and the only thing between N
workers and the client is the gateway. Two tables:

* **paced**: each fake worker runs ``--slots`` requests at once and emits a
  token every ``--token-interval-ms`` ms (default 16 slots, 20 ms: 800
  tokens/s per worker); wrk holds N x ``--slots`` streaming connections, so
  every slot of every worker is busy. Delivered tokens/s over N x one
  worker's is the scaling efficiency (target >= 0.9).
* **flat out**: the same with ``--token-interval-ms 0`` (a token every turn
  of the worker's event loop) and ``--flat-connections`` per worker: the
  workers are as fast as Python allows, so the gateway's figures there are
  its ceiling: requests/s and streamed tokens/s per gateway process, and
  its CPU use (1.0 = one core busy) says whether it was the bottleneck.

Every table is repeated for each ``--processes`` count of the gateway
(``llmgate gateway --processes P``). Nothing is pinned: on a small machine
the workers, wrk and the gateway share the cores, and the CPU columns say
who used them. Results go to ``loadtest/results/<UTC time>-scaling/``
(``results.json``, ``results.csv``, the logs)::

    make bench-scaling
    make bench-scaling ARGS="--workers 1,2,4,8 --processes 1,2 --duration 10"
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from loadtest import machine
from loadtest.pinning import CorePlan
from loadtest.procs import await_ready, healthy_workers, launched, stop_on_signals
from loadtest.report import ROOT, markdown_table, results_dir, stamp, write_json_and_csv
from loadtest.wrk import Scenario, Target, check_answer, cpu_seconds, run_wrk, wrk_script
from shared.ports import free_port

STARTUP_TIMEOUT = 60.0
TARGET_EFFICIENCY = 0.9


@dataclass(frozen=True)
class Layout:
    """One measured configuration."""

    table: str  # "paced" or "flat out"
    workers: int
    processes: int
    token_interval_ms: float
    connections: int


@dataclass
class Row:
    table: str
    workers: int
    processes: int
    connections: int
    token_interval_ms: float
    requests_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    gateway_cpu_util: float  # core-seconds per second, all gateway processes
    workers_cpu_util: float
    wrk_cpu_util: float
    other_cpu_util: float
    # tokens/s over N x the same table's one-worker, one-process figure
    efficiency: float | None = None


def unpinned() -> CorePlan:
    """Every process may run on every core (wrk's threads too: one per core)."""
    cores = tuple(sorted(os.sched_getaffinity(0)))
    return CorePlan(cores, cores, cores)


def start_layout(
    stack: contextlib.ExitStack, layout: Layout, out_dir: Path, tokens: int
) -> tuple[Target, list[int]]:
    """N fake workers and a gateway in front of them (the target, the workers' pids);
    stopped when ``stack`` closes."""
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    name = f"{layout.table.replace(' ', '-')}-n{layout.workers}-p{layout.processes}"
    addresses = []
    worker_pids = []
    for i in range(layout.workers):
        address = f"tcp://127.0.0.1:{free_port()}"
        argv = [
            *(py, "-m", "loadtest.fake_engine", "--bind", address, "--worker-id", f"fake-{i}"),
            *("--token-interval-ms", str(layout.token_interval_ms), "--tokens", str(tokens)),
            *("--capacity", str(max(layout.connections // layout.workers, 1))),
        ]
        worker = stack.enter_context(
            launched(f"fake-{i}", argv, out_dir / f"{name}-fake-{i}.log", env, ROOT)
        )
        addresses.append(address)
        worker_pids.append(worker.pid)
    port = free_port()
    argv = [
        *(py, "-m", "gateway.main", "--workers", ",".join(addresses)),
        *("--port", str(port), "--processes", str(layout.processes)),
    ]
    log = out_dir / f"{name}-gateway.log"
    gateway = stack.enter_context(launched("gateway", argv, log, env, ROOT))
    url = f"http://127.0.0.1:{port}"
    await_ready(
        "gateway",
        gateway,
        log,
        f"{url}/ready",
        STARTUP_TIMEOUT,
        healthy_workers(layout.workers),
    )
    return Target(name, url, worker_pids[0], gateway.pid), worker_pids


def measure(layout: Layout, args: argparse.Namespace, out_dir: Path) -> Row:
    scenario = Scenario(layout.table, layout.connections, True, args.tokens)
    script = out_dir / "wrk-stream.lua"
    script.write_text(wrk_script(scenario.body()))
    with contextlib.ExitStack() as stack:
        target, pids = start_layout(stack, layout, out_dir, args.tokens)
        check_answer(target.url, scenario)
        plan = unpinned()
        if args.warmup > 0:
            run_wrk(target, scenario, args.warmup, plan, script, 0)
        before = sum(cpu_seconds(pid) for pid in pids[1:])
        run = run_wrk(target, scenario, args.duration, plan, script, 1)
        # run_wrk counts the first worker as "the backend"; add the others.
        others = (sum(cpu_seconds(pid) for pid in pids[1:]) - before) / run.seconds
    row = Row(
        table=layout.table,
        workers=layout.workers,
        processes=layout.processes,
        connections=layout.connections,
        token_interval_ms=layout.token_interval_ms,
        requests_per_s=run.requests_per_s,
        tokens_per_s=run.tokens_per_s,
        p50_ms=run.latency_p50_us / 1000,
        p99_ms=run.latency_p99_us / 1000,
        errors=run.errors,
        gateway_cpu_util=run.proxy_cpu_util or 0.0,
        workers_cpu_util=run.backend_cpu_util + others,
        wrk_cpu_util=run.loadgen_cpu_util,
        other_cpu_util=max(run.other_cpu_util - others, 0.0),
    )
    print(
        f"  {row.table:8} N={row.workers} P={row.processes}: {row.requests_per_s:8,.1f} req/s "
        f"{row.tokens_per_s:9,.0f} tok/s, p99 {row.p99_ms:7.1f} ms, gateway CPU "
        f"{row.gateway_cpu_util:.2f}, workers {row.workers_cpu_util:.2f}, wrk "
        f"{row.wrk_cpu_util:.2f}" + (f", {row.errors} ERRORS" if row.errors else ""),
        flush=True,
    )
    return row


def with_efficiency(rows: list[Row]) -> list[Row]:
    """Each paced row's tokens/s over N x the one-worker paced figure at the same
    process count (flat out, the workers are not the limit: no such ratio)."""
    base = {r.processes: r.tokens_per_s for r in rows if r.workers == 1 and r.table == "paced"}
    for r in rows:
        one = base.get(r.processes) if r.table == "paced" else None
        r.efficiency = r.tokens_per_s / (r.workers * one) if one else None
    return rows


COLUMNS = (
    ("table", "table", "{:<8}"),
    ("processes", "P", "{:>2}"),
    ("workers", "N", "{:>2}"),
    ("connections", "conns", "{:>5}"),
    ("requests_per_s", "req/s", "{:>8.1f}"),
    ("tokens_per_s", "tok/s", "{:>8.0f}"),
    ("efficiency", "vs N x 1", "{:>8.2f}"),
    ("p50_ms", "p50 ms", "{:>7.1f}"),
    ("p99_ms", "p99 ms", "{:>7.1f}"),
    ("gateway_cpu_util", "gw CPU", "{:>6.2f}"),
    ("workers_cpu_util", "wk CPU", "{:>6.2f}"),
    ("wrk_cpu_util", "wrk CPU", "{:>7.2f}"),
    ("errors", "errors", "{:>6}"),
)


def format_table(rows: list[Row]) -> str:
    """A Markdown table (docs/benchmarks.md takes it as printed)."""

    def cell(value: object, fmt: str) -> str:
        return "-" if value is None else fmt.format(value).strip()

    header = [title for _, title, _ in COLUMNS]
    return markdown_table(
        header, ([cell(getattr(r, k), fmt) for k, _, fmt in COLUMNS] for r in rows)
    )


def saturation(rows: list[Row]) -> list[str]:
    """The flat-out ceiling per gateway process count."""
    lines = []
    for processes in sorted({r.processes for r in rows}):
        flat = [r for r in rows if r.table == "flat out" and r.processes == processes]
        if not flat:
            continue
        best = max(flat, key=lambda r: r.tokens_per_s)
        lines.append(
            f"gateway --processes {processes}: at most {best.tokens_per_s:,.0f} streamed "
            f"tokens/s and {best.requests_per_s:,.1f} requests/s (N={best.workers}), "
            f"{best.tokens_per_s / processes:,.0f} tokens/s per process, gateway CPU "
            f"{best.gateway_cpu_util:.2f} cores"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.scaling",
        description="One gateway in front of 1..8 FAKE workers (benchmark doubles): "
        "scaling efficiency and the gateway's saturation point.",
    )
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts (comma-separated)")
    parser.add_argument("--processes", default="1,2", help="gateway --processes counts")
    parser.add_argument("--slots", type=int, default=16, help="paced: streams per worker")
    parser.add_argument("--token-interval-ms", type=float, default=20.0, help="paced: ms/token")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request")
    parser.add_argument(
        "--flat-connections", type=int, default=8, help="flat out: streams per worker"
    )
    parser.add_argument("--no-flat", dest="flat", action="store_false", help="paced table only")
    parser.add_argument("--duration", type=int, default=10, help="measured seconds per run")
    parser.add_argument("--warmup", type=int, default=2, help="seconds not counted per run")
    parser.add_argument("--results-dir", type=Path, default=None)
    return parser


def layouts(args: argparse.Namespace) -> list[Layout]:
    counts = [int(n) for n in args.workers.split(",") if n]
    processes = [int(p) for p in args.processes.split(",") if p]
    if not counts or not processes or min(counts + processes) < 1:
        raise SystemExit("--workers and --processes take positive counts")
    if 1 not in counts:
        counts = [1, *counts]  # the efficiency's denominator
    chosen = []
    for p in processes:
        for n in sorted(set(counts)):
            chosen.append(Layout("paced", n, p, args.token_interval_ms, n * args.slots))
        if args.flat:
            for n in sorted(set(counts)):
                chosen.append(Layout("flat out", n, p, 0.0, n * args.flat_connections))
    return chosen


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: `make bench-scaling` installs it")
    chosen = layouts(args)
    started = datetime.now(UTC)
    out_dir = results_dir("scaling", started, args.results_dir)
    print(f"results: {out_dir}", flush=True)
    rows: list[Row] = []
    with stop_on_signals():
        for layout in chosen:
            rows.append(measure(layout, args, out_dir))
    rows = with_efficiency(rows)
    cores = sorted(os.sched_getaffinity(0))
    report = {
        "started": stamp(started),
        "machine": machine.describe(cores),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "rows": [asdict(r) for r in rows],
        "saturation": saturation(rows),
    }
    write_json_and_csv(out_dir, report, rows)
    print()
    print(
        f"{len(cores)} cores; paced: {args.slots} streams per worker, a token every "
        f"{args.token_interval_ms:g} ms, {args.tokens} tokens per request; flat out: "
        f"{args.flat_connections} streams per worker, a token every loop turn; "
        f"{args.duration}s per run"
    )
    print(format_table(rows))
    paced = [r for r in rows if r.table == "paced" and r.efficiency is not None]
    if paced:
        worst = min(paced, key=lambda r: r.efficiency or 0.0)
        verdict = "met" if (worst.efficiency or 0.0) >= TARGET_EFFICIENCY else "NOT met"
        print(
            f"\npaced scaling: worst {worst.efficiency:.2f}x of N x one worker (N={worst.workers}, "
            f"P={worst.processes}); target >= {TARGET_EFFICIENCY}: {verdict}"
        )
    for line in saturation(rows):
        print(line)
    print(f"\nwritten to {out_dir}")


if __name__ == "__main__":
    main()
