"""The gateway-overhead harness: what the gateway itself costs, beside vllm-router.

Zero-cost backends take the model out of the picture, so what is measured
is the proxy's own cost (vllm-router's method):

* ``direct``: wrk -> ``loadtest.zero_cost_http`` (raw ASGI; the baseline);
* ``llmgate``: wrk -> ``llmgate gateway`` -> ZeroMQ -> ``loadtest.fake_engine``
  (the real worker loop around a FAKE engine that answers at once);
* ``vllm-router``: wrk -> vllm-router (PyPI ``vllm-router``, from its own
  virtualenv ``.venv-router``) -> ``loadtest.zero_cost_http``;
* ``llmgate-ipc`` (only when named in ``--targets``): as ``llmgate``, the
  gateway and the worker linked by a Unix socket (``ipc://``) instead of
  loopback TCP;
* ``llmgate-baseline`` (with ``--baseline DIR``): as ``llmgate``, from
  another checkout (``git worktree add DIR REV``), so a change is measured
  beside the previous main in one run, interleaved like every target.

Scenarios, each a wrk run of ``--duration`` seconds after ``--warmup``
seconds not counted, repeated ``--repeats`` times with the targets
interleaved in every repeat (so drift hits all alike):

* ``latency``: one connection, non-streaming ``/v1/completions`` with
  ``max_tokens`` 1. Added latency = a proxy's mean minus ``direct``'s mean
  in the same repeat.
* ``throughput``: ``--connections`` connections, the same request.
* ``stream``: ``--connections`` connections, ``stream: true`` with
  ``max_tokens`` ``--stream-tokens``: one SSE chunk per token, the backends
  emitting one token per event-loop turn.

Per run: requests/s, streamed tokens/s, the proxy's CPU seconds (psutil,
its process tree), requests and tokens per proxy CPU second ("per core"),
proxy CPU seconds per 1,000 requests, the proxy's RSS and peak RSS
(``VmHWM``), and the CPU use of the backend and of wrk, which tells which
process was the bottleneck. Processes are pinned to cores (printed; on 2
cores the proxies get core 1 to themselves, wrk and the backends share core
0). Streamed tokens are counted as finished requests times their tokens:
wrk counts a response only once its body has ended, and each target's
answer is checked token for token before it is loaded. ``--profile`` adds
one py-spy-sampled run of the gateway per scenario (not counted), the worker
around the fake engine sampled at the same time, and prints where their
time goes.

Run it (``make bench-overhead`` installs Debian's ``wrk`` when it is missing)::

    make bench-overhead
    make bench-overhead ARGS="--repeats 5 --duration 10 --profile"

Results go to ``loadtest/results/<UTC time>-overhead/``: ``runs.csv`` (one
row per run), ``summary.csv`` and ``results.json`` (everything, with the
machine, versions and pinning), server logs, and profiles.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest import machine
from loadtest.overhead_report import (
    format_table,
    format_verdicts,
    summarize,
    summary_entries,
    verdicts,
    write_results,
)
from loadtest.overhead_servers import DEFAULT_TARGETS, TARGETS, start_targets
from loadtest.pinning import CorePlan, plan_cores
from loadtest.procs import stop_on_signals
from loadtest.profiles import profile_gateway
from loadtest.report import results_dir, stamp
from loadtest.wrk import (
    SCENARIO_NAMES,
    Run,
    Scenario,
    Target,
    check_answer,
    run_wrk,
    scenarios,
    wrk_script,
)


def measure(
    targets: dict[str, Target],
    chosen: Sequence[Scenario],
    args: argparse.Namespace,
    plan: CorePlan,
    out_dir: Path,
) -> list[Run]:
    """Every scenario on every target, ``--repeats`` times, targets interleaved."""
    scripts = {}
    for scenario in chosen:
        scripts[scenario.name] = out_dir / f"wrk-{scenario.name}.lua"
        scripts[scenario.name].write_text(wrk_script(scenario.body()))
        for target in targets.values():
            check_answer(target.url, scenario)
    runs = []
    for repeat in range(1, args.repeats + 1):
        for scenario in chosen:
            for target in targets.values():
                script = scripts[scenario.name]
                if args.warmup > 0:
                    run_wrk(target, scenario, args.warmup, plan, script, 0)
                run = run_wrk(target, scenario, args.duration, plan, script, repeat)
                runs.append(run)
                shown = (
                    f"{run.tokens_per_s:,.0f} tok/s"
                    if scenario.stream
                    else f"mean {run.latency_mean_us:,.0f} us"
                )
                proxy = (
                    f", proxy CPU {run.proxy_cpu_util:.2f}"
                    if run.proxy_cpu_util is not None
                    else ""
                )
                errors = f", {run.errors} ERRORS" if run.errors else ""
                print(
                    f"  repeat {repeat} {scenario.name:10} {target.name:11} "
                    f"{run.requests_per_s:9,.0f} req/s, {shown}{proxy}{errors}",
                    flush=True,
                )
    return runs


def versions(router_bin: Path | None) -> dict[str, str]:
    out = {"python": platform.python_version()}
    measured = ("llmgate", "fastapi", "starlette", "uvicorn", "uvloop", "httptools", "pyzmq")
    out |= machine.installed_versions((*measured, "msgspec"))
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False)
    out["wrk"] = (wrk.stdout or wrk.stderr).splitlines()[0] if (wrk.stdout or wrk.stderr) else "?"
    if router_bin is not None:
        python = router_bin.parent / "python"
        probe = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
            capture_output=True,
            text=True,
            check=False,
        )
        out["vllm-router"] = probe.stdout.strip() or "?"
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.overhead",
        description="The gateway's own cost over a zero-cost worker, beside vllm-router.",
    )
    parser.add_argument("--duration", type=int, default=5, help="seconds per measured run")
    parser.add_argument("--warmup", type=int, default=1, help="seconds before each run (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--connections", type=int, default=64, help="for throughput and stream")
    parser.add_argument("--stream-tokens", type=int, default=64, help="tokens per streamed answer")
    parser.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"comma-separated, of: {', '.join(TARGETS)}",
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIO_NAMES), help="comma-separated")
    parser.add_argument(
        "--router-bin",
        type=Path,
        default=None,
        help="vllm-router executable (default: .venv-router's, installed on first use)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="py-spy the gateway and the fake worker afterwards"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a checkout of another commit (git worktree add DIR REV): adds the target "
        "llmgate-baseline, its gateway and worker, measured beside this one's in the same run",
    )
    parser.add_argument("--results-dir", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    names = [t for t in args.targets.split(",") if t]
    if args.baseline is not None and "llmgate-baseline" not in names:
        names.append("llmgate-baseline")
    if "llmgate-baseline" in names and args.baseline is None:
        raise SystemExit("llmgate-baseline needs --baseline DIR (a checkout of the other commit)")
    wanted = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(names) - set(TARGETS)) + sorted(set(wanted) - set(SCENARIO_NAMES))
    if unknown or args.repeats < 1:
        raise SystemExit(f"unknown target or scenario {unknown}, or --repeats < 1")
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: `apt-get install wrk` (Debian/Ubuntu)")
    router_bin: Path | None = None
    if "vllm-router" in names:
        # make bench's: one virtualenv for both, created under a lock on first use.
        from loadtest.targets import ensure_router

        router_bin = args.router_bin or ensure_router()
    cores = sorted(os.sched_getaffinity(0))
    plan = plan_cores(cores)
    # This script only waits on wrk; it stays off the proxy's core.
    os.sched_setaffinity(0, plan.loadgen)
    all_scenarios = scenarios(args.connections, args.stream_tokens)
    chosen = [all_scenarios[name] for name in SCENARIO_NAMES if name in wanted]
    started = datetime.now(UTC)
    out_dir = results_dir("overhead", started, args.results_dir)
    print(f"pinning: {plan.describe()}", flush=True)
    print(f"results: {out_dir}", flush=True)
    runs: list[Run] = []
    profiles: dict[str, Any] = {}
    with stop_on_signals(), contextlib.ExitStack() as stack:
        targets = start_targets(stack, names, plan, out_dir, router_bin, args.baseline)
        runs = measure(targets, chosen, args, plan, out_dir)
        if args.profile and "llmgate" in targets:
            profiles = profile_gateway(targets["llmgate"], chosen, args, plan, out_dir)
    summary = summarize(runs)
    judged = verdicts(summary)
    report = {
        "started": stamp(started),
        "machine": machine.describe(cores),
        "versions": versions(router_bin),
        "pinning": {**asdict(plan), "description": plan.describe()},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "scenarios": [asdict(s) for s in chosen],
        "runs": [asdict(r) for r in runs],
        "summary": summary_entries(summary),
        "verdicts": [asdict(v) for v in judged],
        "profiles": profiles,
    }
    write_results(out_dir, runs, report)
    print(f"\n{args.repeats} repeats of {args.duration:g}s; each cell: median [min-max]")
    print(f"pinning: {plan.describe()}")
    print(format_table(summary))
    print("\ngateway targets (issue 6):")
    print(format_verdicts(judged))
    print(f"\nwritten to {out_dir}")


if __name__ == "__main__":
    main()
