"""``make bench``: llmgate side by side with vLLM, vllm-router and the seeds' baseline.

One run, one machine, one model (the embedded SmolLM2-135M-Instruct, float32,
the same engine flags everywhere), the targets one after the other, never two
at once (``loadtest.targets`` says what each is):

    llmgate-1  llmgate-2  vllm-direct  vllm-direct-default  vllm-router-2
    fastapi-batching  vllm-inprocess

``--model DIR`` (and ``--dtype``) serve a model from this host's disk under
the same name everywhere; on a GPU host the ``-1`` targets get GPU 0 and the
``-2`` targets GPUs 0 and 1 (``loadtest/gpu_bench.sh`` runs it there).

``--scenario multiturn`` runs ``loadtest.multiturn`` instead: multi-turn chat
over two workers under each routing policy (its own flags; see there);
``--scenario rag`` runs ``loadtest.rag``: shared documents over two workers
under each policy; ``--scenario fleet`` runs ``loadtest.fleet``: the policies
in front of 32 SIMULATED engines, behind 1 and 8 gateway processes.

The workload is the seed scenario: ``--users`` closed-loop clients (40) each
stream ``/v1/completions`` for "Hello World, what is your name dog?" with
``max_tokens`` 10 (``--long``: 128), greedy and with ``ignore_eos`` so every
target generates the same tokens, and send the next request when one ends.
``--warmup`` seconds (10) are not counted, then ``--duration`` seconds (60)
are. Reported per target: requests/s and p50/p99 end-to-end latency of the
requests that ended in the window (HTTP 200), output tokens/s that arrived
in it, mean time to first token and mean inter-token latency (gaps between
the stream's text events), errors; then the ratios the issue sets targets
for, on tokens/s. Engines run with ``--enforce-eager`` unless
``--no-enforce-eager`` is given: vLLM 0.32's CPU build fails to reload its
torch.compile cache here, so every compiled start takes about 2.5 minutes
and the seven engine starts would not fit the 15 minutes a default run has.

Each server starts on free loopback ports in its own process group and is
stopped with its whole process tree before the next starts, also on Ctrl-C,
SIGTERM or an error. Results go to ``loadtest/results/<UTC time>-bench/``:
``results.json``, ``results.csv``, ``bench.png`` and every server's log.

    make bench                                    # every target, defaults
    make bench ARGS="--targets llmgate-1,vllm-direct --duration 10"
    .venv/bin/python -m loadtest.bench --long     # 128-token outputs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from loadtest import cpu_use, targets
from loadtest.closed_loop import Sample, Stats, completion_payload, http_completion, run_closed_loop
from loadtest.closed_loop import summarize as summarize_samples
from loadtest.machine import vllm_version
from loadtest.procs import launched, log_tail, raise_interrupt
from loadtest.report import ROOT, TextColumn, results_dir, text_table, write_csv, write_json

PROMPT = "Hello World, what is your name dog?"
LONG_MAX_TOKENS = 128


# --- measuring ------------------------------------------------------------


async def load_http(target: str, base_url: str, args: argparse.Namespace) -> Stats:
    payload = completion_payload(targets.MODEL, PROMPT, args.max_tokens, stream=args.stream)
    limits = httpx.Limits(max_connections=args.users, max_keepalive_connections=args.users)
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=args.request_timeout
    ) as client:

        async def send(sample: Sample) -> None:
            await http_completion(client, payload, sample)

        print(_load_line(target, args), flush=True)
        run = await run_closed_loop(send, args.users, args.warmup, args.duration)
    return summarize_samples(target, *run.window(), run.cpu_cores)


def _load_line(target: str, args: argparse.Namespace) -> str:
    return (
        f"[{target}] {args.users} users, max_tokens {args.max_tokens}: "
        f"{args.warmup:g}s warmup + {args.duration:g}s measured"
    )


def measure_inprocess(args: argparse.Namespace, engine: targets.Engine, run_dir: Path) -> Stats:
    """Run ``loadtest.inprocess`` in a child (its engine processes go with it)."""
    target = "vllm-inprocess"
    out = run_dir / f"{target}.json"
    argv = [
        *(sys.executable, "-m", "loadtest.inprocess", "--out", str(out)),
        *("--users", str(args.users), "--duration", str(args.duration)),
        *("--warmup", str(args.warmup), "--max-tokens", str(args.max_tokens)),
        *("--prompt", PROMPT, *engine.flags, "--dtype", engine.dtype),
        *(("--model-dir", engine.model_dir) if engine.model_dir else ()),
    ]
    log = run_dir / f"{target}.log"
    env = {**targets.engine_env(), **engine.gpu_env(1)}
    with launched(target, argv, log, env, ROOT) as proc:
        limit = engine.startup_timeout + args.warmup + args.duration + 60
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"[{target}] did not finish in {limit:.0f}s") from None
        if code != 0 or not out.exists():
            raise RuntimeError(f"[{target}] exited with {code}; log tail:\n{log_tail(log)}")
    return stats_from_dict(json.loads(out.read_text()))


def stats_from_dict(data: dict[str, Any]) -> Stats:
    names = {f.name for f in fields(Stats)}
    return Stats(**{k: v for k, v in data.items() if k in names})


def measure(target: str, args: argparse.Namespace, run_dir: Path) -> Stats:
    engine = targets.Engine(
        enforce_eager=args.enforce_eager,
        startup_timeout=args.startup_timeout,
        model_dir=args.model,
        dtype=args.dtype,
        gpus=args.gpus,
        block_size=args.block_size,
    )
    if target == "vllm-inprocess":
        return measure_inprocess(args, engine, run_dir)
    with targets.serving(target, engine, run_dir) as url:
        return asyncio.run(load_http(target, url, args))


# --- reporting ------------------------------------------------------------

COLUMNS: tuple[TextColumn, ...] = (
    ("target", "target", "{:<16}", 16),
    ("requests_per_s", "req/s", "{:>7.2f}", 7),
    ("output_tokens_per_s", "tok/s", "{:>7.1f}", 7),
    ("p50_ms", "p50 ms", "{:>7.0f}", 7),
    ("p99_ms", "p99 ms", "{:>7.0f}", 7),
    ("mean_ttft_ms", "TTFT ms", "{:>8.0f}", 8),
    ("mean_itl_ms", "ITL ms", "{:>7.1f}", 7),
    ("ok", "ok", "{:>6}", 6),
    ("errors", "errors", "{:>6}", 6),
)


def format_table(results: list[Stats]) -> str:
    lines = [text_table(COLUMNS, results)]
    lines += [f"{name} (tok/s): {value:.2f}x" for name, value in ratios(results).items()]
    # Where the cores went (loadtest.cpu_use); for vllm-inprocess the bench
    # client is also vLLM's front end.
    lines += [
        f"{r.target} cores used: {cpu_use.format_cores(r.cpu_cores)}"
        for r in results
        if r.cpu_cores
    ]
    return "\n".join(lines)


# (label, numerator target, denominator target). On output tokens/s: with
# ignore_eos that is requests/s times max_tokens, and it does not jump with
# where the users' waves of identical requests fall relative to the window.
RATIOS = (
    ("llmgate-1 / vllm-direct", "llmgate-1", "vllm-direct"),
    ("llmgate-2 / vllm-router-2", "llmgate-2", "vllm-router-2"),
    ("llmgate-1 / fastapi-batching", "llmgate-1", "fastapi-batching"),
    ("llmgate-2 / fastapi-batching", "llmgate-2", "fastapi-batching"),
    ("vllm-direct / fastapi-batching", "vllm-direct", "fastapi-batching"),
    ("llmgate-1 / vllm-inprocess", "llmgate-1", "vllm-inprocess"),
    ("llmgate-1 / vllm-direct-default", "llmgate-1", "vllm-direct-default"),
    ("llmgate-1-preload / llmgate-1", "llmgate-1-preload", "llmgate-1"),
)


def ratios(results: list[Stats]) -> dict[str, float]:
    """The throughput ratios the issue's targets are stated in, for targets that ran."""
    rate = {r.target: r.output_tokens_per_s for r in results if r.ok}
    return {
        label: rate[top] / rate[bottom]
        for label, top, bottom in RATIOS
        if top in rate and rate.get(bottom)
    }


def write_results(
    run_dir: Path, started: datetime, args: argparse.Namespace, results: list[Stats]
) -> None:
    document = {
        "date": started.isoformat(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "vllm_version": vllm_version(),
        "router_package": targets.ROUTER_PACKAGE,
        "model": targets.MODEL,
        "parameters": {
            **{k: v for k, v in vars(args).items() if k != "targets"},
            "targets": args.targets,
            "prompt": PROMPT,
            "endpoint": "/v1/completions",
            "temperature": 0.0,
            "ignore_eos": True,
        },
        "results": [asdict(r) for r in results],
        "ratios_output_tokens_per_s": ratios(results),
    }
    write_json(run_dir / "results.json", document)
    write_csv(run_dir / "results.csv", results, [key for key, *_ in COLUMNS] + ["measured_s"])


def plot(path: Path, results: list[Stats], title: str) -> None:
    """Three bar panels: requests/s, output tokens/s, p50/p99 latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.target for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    panels = (
        ("requests/s", [r.requests_per_s for r in results]),
        ("output tokens/s", [r.output_tokens_per_s for r in results]),
    )
    for ax, (label, values) in zip(axes, panels, strict=False):
        bars = ax.bar(names, values, color="tab:blue")
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(label)
    ax = axes[2]
    xs = range(len(results))
    p50 = [r.p50_ms or 0 for r in results]
    p99 = [r.p99_ms or 0 for r in results]
    ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
    ax.set_xticks(list(xs), names)
    ax.set_title("end-to-end latency (ms)")
    ax.legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- command line ---------------------------------------------------------


SCENARIOS = ("seed", "multiturn", "rag", "fleet")


def _add_scenario(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="seed",
        help="seed: the targets side by side (default); multiturn: multi-turn chat over "
        "two workers under each routing policy (loadtest.multiturn, its own flags); rag: "
        "shared documents over two workers under each policy (loadtest.rag, its own flags); "
        "fleet: the policies before 32 SIMULATED engines (loadtest.fleet, its own flags)",
    )


def _scenario_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    _add_scenario(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench",
        description="llmgate against vLLM, vllm-router, a FastAPI batching baseline and "
        "vLLM in-process, one after the other, on the same model and cores.",
    )
    _add_scenario(parser)
    parser.add_argument(
        "--targets",
        default="all",
        help=f"comma-separated subset of: {', '.join(targets.TARGETS)} (default: all)",
    )
    parser.add_argument("--users", type=int, default=40, help="concurrent closed-loop clients")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds not counted")
    parser.add_argument("--max-tokens", type=int, default=10, help="output tokens per request")
    parser.add_argument(
        "--long",
        action="store_true",
        help=f"{LONG_MAX_TOKENS}-token outputs (sets --max-tokens {LONG_MAX_TOKENS})",
    )
    parser.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="plain JSON responses (no TTFT/ITL)",
    )
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pass --enforce-eager to every engine: ~30 s starts instead of ~2.5 min "
        "of torch.compile each; --no-enforce-eager measures compiled engines",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a model directory on this host's disk for every target (default: the embedded "
        "model); served as " + targets.MODEL,
    )
    parser.add_argument(
        "--dtype", default="float32", help="every engine's dtype (auto: the model's own)"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="every engine's vLLM --block-size (KV-cache block in tokens); 0: each target's "
        "own default (on CPU llmgate's workers 32, vLLM 128; on GPU 16)",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds a server may take to start"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="seconds one request may take before it counts as an error",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    scenario, rest = _scenario_parser().parse_known_args(argv)
    if scenario.scenario == "multiturn":
        from loadtest import multiturn

        return multiturn.main(rest)
    if scenario.scenario == "rag":
        from loadtest import rag

        return rag.main(rest)
    if scenario.scenario == "fleet":
        from loadtest import fleet

        return fleet.main(rest)
    args = build_parser().parse_args(rest)
    if args.long:
        args.max_tokens = LONG_MAX_TOKENS
    if args.users < 1 or args.duration <= 0 or args.warmup < 0 or args.max_tokens < 1:
        raise SystemExit("--users, --duration and --max-tokens must be positive, --warmup >= 0")
    try:
        chosen = targets.parse_targets(args.targets)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    args.targets = ",".join(chosen)
    from serve.plan import count_gpus

    # On a GPU host "-1" targets get one GPU and "-2" targets two (loadtest/gpu_bench.sh).
    args.gpus = count_gpus()
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so every server is stopped;
    # SIGINT too when started in the background, where it would be ignored.
    signal.signal(signal.SIGTERM, raise_interrupt)
    signal.signal(signal.SIGINT, raise_interrupt)

    from worker.embedded_model import ensure_model

    ensure_model()  # a fresh clone converts the embedded model once, here
    started = datetime.now(UTC)
    run_dir = results_dir("bench", started)
    print(f"results and logs: {run_dir.relative_to(ROOT)}/", flush=True)
    results: list[Stats] = []
    failed: list[str] = []
    clock = time.monotonic()
    try:
        for target in chosen:
            try:
                results.append(measure(target, args, run_dir))
            except RuntimeError as exc:  # one target failing does not lose the others
                print(exc, file=sys.stderr, flush=True)
                failed.append(target)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if results:
            write_results(run_dir, started, args, results)
    title = (
        f"{started:%Y-%m-%d %H:%M} UTC, {platform.machine()}, {len(os.sched_getaffinity(0))} "
        f"cores, {args.gpus} GPUs, vLLM {vllm_version()}, {args.model or targets.MODEL} "
        f"{args.dtype}, {args.users} users, "
        f"max_tokens {args.max_tokens}, {'eager' if args.enforce_eager else 'compiled'}"
        + (f", block size {args.block_size}" if args.block_size else "")
    )
    if results:
        plot(run_dir / "bench.png", results, title)
    print()
    print(title)
    print(format_table(results))
    for r in results:
        if r.error_kinds:
            print(f"{r.target} errors: {r.error_kinds}")
    print(f"\nwall time {time.monotonic() - clock:.0f}s; results: {run_dir.relative_to(ROOT)}/")
    if failed:
        print(f"failed: {', '.join(failed)} (see their logs)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
