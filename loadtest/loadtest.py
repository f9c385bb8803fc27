"""``make loadtest``: Locust scenarios against llmgate, with a summary and a plot.

Scenarios (``--scenario``, default ``all``, run one after the other):

* ``seed``: the seeds' request, POST ``/v1/completions`` with "Hello World,
  what is your name dog?" and ``max_tokens`` 10, by ``--seed-users`` (40)
  closed-loop users for ``--duration`` seconds.
* ``chat-stream``: streamed ``/v1/chat/completions`` (``--chat-max-tokens``
  64) by ``--chat-users`` (40) users for ``--duration`` seconds; reports
  time to first token (TTFT) and inter-token latency (ITL) from the SSE stream.
* ``sweep``: the seed request at ``--sweep-users`` (24, 64, 128, 256) users,
  ``--step-duration`` seconds each.
* ``connections`` and ``soak`` (not part of ``all``; ``loadtest.capacity``,
  ``loadtest.soak``): ``--connections`` (1,000) streams held at once, and
  ``--soak-duration`` or ``--duration`` (30 min) of steady mixed load (whole
  and streamed chats and completions, clients leaving mid-stream, a key over
  its limit) with each server process's memory and file descriptors sampled;
  ``--soak-beside-vllm`` loads a ``vllm serve`` beside it the same way.
* ``spillover`` (not part of ``all``; ``loadtest.spillover``): bursts beyond
  the tier-1 pool's slots of the two-pools example (docs/models.md), with spill-over
  on and off; latency p50/p99 and which pool answered.
* ``batch`` (not part of ``all``; ``loadtest.batches``): interactive latency
  idle and while a batch job runs, the batch's throughput against the same
  requests sent interactively, cache hit against miss latency, precompute;
  with ``--gateways N``, N gateways sharing the state store (``--state-db``
  for PostgreSQL) run the batch: its lines/s on 1 and on N gateways.
* ``tenants`` (not part of ``all``; ``loadtest.tenants``): one API key
  floods the gateway while another sends a trickle of short chats; the
  trickle's TTFT and latency alone, beside the flood with fair sharing on,
  and with it off.
* ``budget`` (not part of ``all``; ``loadtest.budget_race``): a key's daily
  token budget under 64 requests at once over two gateways sharing Redis,
  ``--race-runs`` (10) times: how far spend went past the budget.
* ``rolling`` (not part of ``all``; ``loadtest.rolling``): ``--chat-users``
  streaming clients over two workers, ``--duration`` seconds undisturbed,
  then every worker restarted in turn (SIGHUP to ``llmgate serve``) under
  the same load: client-visible errors, p50/p99 latency and TTFT of each
  phase, streams moved and tokens computed again.

Each run (scenario or sweep step) is its own headless Locust process; the
first ``--warmup`` seconds of each are not counted. Throughput is the number
of requests that completed inside the measured window divided by its length.

Target: ``--url`` for a running server; by default ``python -m
serve`` (``llmgate serve``: one worker, the embedded model, compiled
unless ``--enforce-eager``) is started on free ports and stopped afterwards,
also on Ctrl-C or an error. ``--web`` opens Locust's web UI instead of the
headless runs.

Written to ``loadtest/results/<UTC time>-loadtest/``: per run Locust's CSV
(``<run>_stats.csv``, ...), HTML report (``<run>.html``), log and the exact
final figures (``<run>_summary.json``); the server's log; ``summary.csv`` and
``summary.json`` (figures, date, machine, model, versions, parameters) and
``sweep.png`` (throughput and p50/p99 latency against users).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, fields
from datetime import UTC, datetime
from pathlib import Path

import httpx

from loadtest import machine, procs, targets
from loadtest.locust_runs import (
    SCENARIOS,
    Summary,
    locust_argv,
    parse_locust_summary,
    plan_runs,
    planned_seconds,
    run_locust,
    stop_locust,
    summarize,
    web_argv,
)
from loadtest.report import ROOT, TextColumn, results_dir, text_table, write_csv, write_json

CAPACITY_SCENARIOS = ("connections", "soak")
SPILLOVER = "spillover"
BATCH = "batch"
TENANTS = "tenants"
BUDGET = "budget"
ROLLING = "rolling"
# Seconds past a run's planned end before its Locust process counts as hung.
LOCUST_GRACE_S = 120.0
# Measured seconds of seed and chat-stream when --duration is not given.
DEFAULT_DURATION = 60.0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


TABLE_COLUMNS: tuple[TextColumn, ...] = (
    ("run", "run", "{:<12}", 12),
    ("users", "users", "{:>5}", 5),
    ("requests_per_s", "req/s", "{:>7.2f}", 7),
    ("requests", "requests", "{:>8}", 8),
    ("failures", "failures", "{:>8}", 8),
    ("p50_ms", "p50 ms", "{:>7.0f}", 7),
    ("p99_ms", "p99 ms", "{:>7.0f}", 7),
    ("ttft_mean_ms", "TTFT ms", "{:>7.0f}", 7),
    ("itl_mean_ms", "ITL ms", "{:>7.1f}", 7),
)


def format_table(rows: Sequence[Summary]) -> str:
    return text_table(TABLE_COLUMNS, rows)


SUMMARY_COLUMNS = [f.name for f in fields(Summary)]


def write_summary(run_dir: Path, meta: dict[str, object], rows: Sequence[Summary]) -> None:
    write_csv(run_dir / "summary.csv", rows, SUMMARY_COLUMNS)
    write_json(run_dir / "summary.json", {**meta, "results": [asdict(r) for r in rows]})


def versions() -> dict[str, str]:
    return {
        "llmgate": machine.package_version("llmgate"),
        "vllm": machine.vllm_version(),
        "locust": machine.package_version("locust"),
        "python": platform.python_version(),
    }


@contextlib.contextmanager
def target(args: argparse.Namespace, run_dir: Path) -> Iterator[str]:
    """The base URL to load: ``--url``, or an ``llmgate serve`` started for this run."""
    if args.url:
        url = str(args.url).rstrip("/")
        procs.wait_ready(url + "/v1/models", args.startup_timeout)
        yield url
        return
    engine = targets.Engine(args.enforce_eager, args.startup_timeout)
    with targets.serving("llmgate-1", engine, run_dir) as url:
        yield url


# --- main ------------------------------------------------------------------


def run_headless(args: argparse.Namespace, url: str, run_dir: Path, rows: list[Summary]) -> None:
    """Each planned run in turn; ``rows`` grows as they finish, so an error keeps the rest."""
    for run in plan_runs(args):
        prefix = run_dir / run.name
        print(
            f"[{run.name}] {run.users} users: {run.warmup:g}s warmup + {run.duration:g}s measured",
            flush=True,
        )
        argv = locust_argv(run, url, prefix, args)
        run_locust(argv, run_dir / f"{run.name}.log", run.warmup + run.duration + LOCUST_GRACE_S)
        row = summarize(run, parse_locust_summary(Path(f"{prefix}_summary.json").read_text()))
        print(
            f"[{run.name}] {row.requests_per_s:.2f} req/s, p50 {_ms(row.p50_ms)} ms, "
            f"p99 {_ms(row.p99_ms)} ms, {row.failures} failures",
            flush=True,
        )
        rows.append(row)


def run_web(args: argparse.Namespace, url: str, run_dir: Path) -> None:
    argv = web_argv(url, run_dir / "web", args)
    print(f"Locust web UI: http://127.0.0.1:{args.web_port} (target {url}); Ctrl-C to stop")
    proc = subprocess.Popen(argv, cwd=ROOT)
    try:
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_locust(proc)


def run_capacity(args: argparse.Namespace, run_dir: Path, started: datetime) -> int:
    """The ``connections`` or ``soak`` scenario (``loadtest.capacity``, ``loadtest.soak``)."""
    from loadtest import capacity, soak

    if args.scenario == "connections" and not args.url:
        # Queued streams wait for a slot instead of timing out after 30 s.
        os.environ["LLMGATE_QUEUE_TIMEOUT"] = str(capacity.CONNECTIONS_QUEUE_TIMEOUT_S)
    keyed = args.scenario == "soak" and not args.url
    if keyed:
        # The users' key and the limited one (some 429s), for the gateway started here.
        os.environ["LLMGATE_API_KEYS_FILE"] = str(soak.keys_file(run_dir))
    try:
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(target(args, run_dir))
            model = args.model or procs.served_model(url, soak.USERS_KEY if keyed else None)
            pid = capacity.server_pid_of(url)
            if args.scenario == "connections":
                print(f"[connections] {args.connections} streams at once", flush=True)
                report = asyncio.run(
                    capacity.connections(url, model, args.connections, args.connection_tokens, pid)
                )
            else:
                beside = beside_pid = None
                if args.soak_beside_vllm:
                    engine = targets.Engine(args.enforce_eager, args.startup_timeout)
                    beside = stack.enter_context(targets.serving("vllm-direct", engine, run_dir))
                    beside_pid = soak.vllm_pid_of(beside)
                print(
                    f"[soak] {args.soak_users} users for {args.soak_duration:g}s"
                    + (" on llmgate and on vllm serve beside it" * bool(beside)),
                    flush=True,
                )
                report = asyncio.run(
                    soak.soak(
                        url,
                        model,
                        args.soak_users,
                        args.soak_duration,
                        args.sample_every,
                        run_dir,
                        server_pid=pid,
                        keyed=keyed,
                        beside=beside,
                        beside_pid=beside_pid,
                    )
                )
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    report = {
        **report,
        "date": started.isoformat(),
        "machine": machine.summary(),
        "model": model,
        "target": args.url or "llmgate serve" + (" --enforce-eager" * args.enforce_eager),
        "versions": versions(),
    }
    write_json(run_dir / "summary.json", report)
    print(capacity.format_report(report))
    print(f"results: {run_dir.relative_to(ROOT)}/summary.json")
    return 0


def _users_list(text: str) -> list[int]:
    users = [int(part) for part in text.split(",") if part.strip()]
    if not users or min(users) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive user counts")
    return users


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.loadtest",
        description="Locust load test of llmgate: seed scenario, streamed chat, users sweep.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--scenario",
        choices=[
            *(*SCENARIOS, "all", *CAPACITY_SCENARIOS),
            *(SPILLOVER, BATCH, TENANTS, BUDGET, ROLLING),
        ],
        default="all",
    )
    add("--url", default=None, help="load this running server instead of starting llmgate")
    add("--web", action="store_true", help="open Locust's web UI instead of the headless runs")
    add("--web-port", type=int, default=8089, help="port of the web UI")
    add("--enforce-eager", action="store_true", help="start llmgate eager (no compile)")
    add(
        "--duration",
        type=float,
        default=None,
        help="measured seconds of seed and chat-stream (60); for soak: --soak-duration",
    )
    add("--step-duration", type=float, default=60.0, help="measured seconds per sweep step")
    add("--warmup", type=float, default=20.0, help="seconds not counted at the start of each run")
    add("--seed-users", type=int, default=40, help="users of the seed scenario")
    add("--chat-users", type=int, default=40, help="users of the chat-stream scenario")
    add("--sweep-users", type=_users_list, default=[24, 64, 128, 256], help="e.g. 24,64,128,256")
    add("--max-tokens", type=int, default=10, help="max_tokens of the seed request")
    add("--chat-max-tokens", type=int, default=64, help="max_tokens of the streamed chat")
    add("--model", default="", help="model name in requests (default: the server's first)")
    add("--startup-timeout", type=float, default=600.0, help="seconds to wait for the server")
    add("--connections", type=int, default=1000, help="streams held at once (connections)")
    add("--connection-tokens", type=int, default=16, help="max_tokens of each (connections)")
    add("--soak-users", type=int, default=16, help="closed-loop users (soak)")
    add("--soak-duration", type=float, default=1800.0, help="seconds of load (soak)")
    add("--sample-every", type=float, default=10.0, help="seconds between samples (soak)")
    add(
        "--soak-beside-vllm",
        action="store_true",
        help="soak: the same users on a vllm serve of the same model beside it",
    )
    add("--race-runs", type=int, default=10, help="runs, each a fresh key (budget)")
    add("--race-requests", type=int, default=64, help="requests sent at once per run (budget)")
    add("--race-tokens", type=int, default=16, help="max_tokens of each (budget)")
    add("--race-budget", type=int, default=300, help="first run's tokens a day (budget)")
    add("--bursts", type=int, default=3, help="bursts per mode (spillover)")
    add("--burst", type=int, default=24, help="requests sent at once per burst (spillover)")
    add("--burst-tokens", type=int, default=64, help="max_tokens of each (spillover)")
    add("--interactive-users", type=int, default=4, help="closed-loop users (batch)")
    add("--interactive-seconds", type=float, default=30.0, help="seconds per phase (batch)")
    add("--interactive-tokens", type=int, default=32, help="max_tokens of each (batch)")
    add("--batch-lines", type=int, default=1000, help="lines of the batch job (batch)")
    add("--batch-tokens", type=int, default=16, help="max_tokens of each line (batch)")
    add("--direct-concurrency", type=int, default=32, help="clients sending the lines (batch)")
    add("--cache-requests", type=int, default=50, help="requests sent twice (batch)")
    add(
        "--gateways",
        type=int,
        default=1,
        help="gateways sharing the state store that run the batch together (batch); "
        "gateways the flood and the trickle go over, round-robin (tenants)",
    )
    add(
        "--state-db",
        default="",
        help="PostgreSQL URL of the gateways' state store; empty = SQLite in the run's "
        "directory (batch)",
    )
    add("--flood-users", type=int, default=64, help="flooding key's closed-loop users (tenants)")
    add("--flood-tokens", type=int, default=128, help="max_tokens of each flood request (tenants)")
    add("--trickle-requests", type=int, default=20, help="the other key's chats (tenants)")
    add("--trickle-interval", type=float, default=1.5, help="seconds between them (tenants)")
    add("--trickle-tokens", type=int, default=16, help="max_tokens of each chat (tenants)")
    add("--tenant-slots", type=int, default=8, help="--max-inflight-per-worker (tenants)")
    return parser


def resolve_durations(args: argparse.Namespace) -> argparse.Namespace:
    """``--duration`` is the soak's length under ``--scenario soak`` (as
    ``--soak-duration``), else the seed and chat-stream runs' (60 s unless given)."""
    if args.duration is not None and args.scenario == "soak":
        args.soak_duration = args.duration
    if args.duration is None:
        args.duration = DEFAULT_DURATION
    return args


def main(argv: list[str] | None = None) -> int:
    args = resolve_durations(build_parser().parse_args(argv))
    if args.duration <= 0 or args.step_duration <= 0 or args.warmup < 0:
        raise SystemExit("--duration and --step-duration must be > 0, --warmup >= 0")
    if min(args.seed_users, args.chat_users) < 1:
        raise SystemExit("--seed-users and --chat-users must be >= 1")
    if args.gateways < 1:
        raise SystemExit("--gateways must be >= 1")
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the server is stopped.
    signal.signal(signal.SIGTERM, procs.raise_interrupt)
    started = datetime.now(UTC)
    run_dir = results_dir("loadtest", started)
    if args.scenario in CAPACITY_SCENARIOS:
        print(f"{args.scenario}; results: {run_dir}")
        return run_capacity(args, run_dir, started)
    if args.scenario in (BATCH, SPILLOVER, TENANTS, BUDGET, ROLLING):
        print(f"{args.scenario}; results: {run_dir}")
        if args.scenario == ROLLING:
            from loadtest import rolling as scenario

            report = scenario.run(run_dir, args)
        elif args.scenario == BUDGET:
            from loadtest import budget_race as scenario

            report = scenario.run(run_dir, args)
        elif args.scenario == BATCH:
            from loadtest import batches as scenario

            report = scenario.run(run_dir, args)
        elif args.scenario == TENANTS:
            from loadtest import tenants as scenario

            report = scenario.run(run_dir, args)
        else:
            from loadtest import spillover as scenario

            report = scenario.run(run_dir, args.bursts, args.burst, args.burst_tokens)
        report |= {
            "date": started.isoformat(),
            "machine": machine.summary(),
            "versions": versions(),
        }
        write_json(run_dir / "summary.json", report)
        print(scenario.format_report(report))
        return 0
    if not args.web:
        runs = plan_runs(args)
        print(f"{len(runs)} runs, {planned_seconds(runs) / 60:.1f} min of load; results: {run_dir}")
    wall = time.monotonic()
    rows: list[Summary] = []
    try:
        with target(args, run_dir) as url:
            args.model = args.model or procs.served_model(url)
            if args.web:
                run_web(args, url, run_dir)
                return 0
            run_headless(args, url, run_dir, rows)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, httpx.HTTPError) as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        if rows:
            meta = {
                "date": started.isoformat(),
                "wall_s": round(time.monotonic() - wall, 1),
                "machine": machine.summary(),
                "model": args.model,
                "target": args.url or ("llmgate serve" + (" --enforce-eager" * args.enforce_eager)),
                "engine": "external"
                if args.url
                else ("eager" if args.enforce_eager else "compiled"),
                "versions": versions(),
                "parameters": vars(args),
                "notes": "Locust rounds percentiles to 2 significant digits (above 100 ms)",
            }
            write_summary(run_dir, meta, rows)
    from loadtest.plot import plot_sweep  # matplotlib: only once there is something to plot

    png = run_dir / "sweep.png"
    engine = "" if args.url else (" (eager)" if args.enforce_eager else " (compiled)")
    title = f"seed request, {args.model}{engine}, {started:%Y-%m-%d}"
    plotted = plot_sweep(rows, png, title=title)
    print()
    print(format_table(rows))
    print(f"\nresults: {run_dir.relative_to(ROOT)}/ (summary.csv, summary.json", end="")
    print(", sweep.png)" if plotted else ")")
    print(f"wall time: {time.monotonic() - wall:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
