"""Smoke benchmark: llmgate against vLLM's own OpenAI server, like with like.

It measures the "seed scenario" on each target, one after the other (never both
at once): ``--users`` closed-loop clients (default 40) each send the same short
``/v1/completions`` request ("Hello World, what is your name dog?",
``max_tokens`` 10, the server's default sampling), wait for the full response
and send the next, for ``--duration`` seconds (default 20) after ``--warmup``
seconds that are not counted (default 5). Only HTTP 200 responses count as
successes; anything else is an error. Reported per target: requests/s
(successes / measured seconds), p50 and p99 latency of the successes, and the
ratio llmgate / vllm-direct.

Targets, both serving the embedded SmolLM2-135M-Instruct in float32:

* ``vllm-direct``: ``python -m vllm.entrypoints.openai.api_server``.
* ``llmgate``: ``python -m worker.launcher`` (``llmgate serve``): one worker and
  the gateway; or an already running gateway with ``--gateway-url``.

Each server starts on free loopback ports, in its own process group, and is
stopped (SIGTERM, SIGKILL after 30 s) before the next one starts, also on
Ctrl-C or an error. Without ``--enforce-eager`` (what users run) each start
compiles for about two minutes; with it, starts take about 30 s.

Run it::

    make bench-smoke                                   # both targets, defaults
    make bench-smoke ARGS="--enforce-eager --duration 5 --warmup 2"
    .venv/bin/python -m loadtest.bench_smoke --target llmgate \\
        --gateway-url http://127.0.0.1:8000

Figures and server logs go to ``loadtest/results/<UTC time>-bench-smoke/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

import httpx

# Shared with ``make bench`` (loadtest.bench); re-exported for loadtest.loadtest.
from loadtest.closed_loop import percentile
from loadtest.procs import free_port, stop_server, vllm_version, wait_ready

ROOT = Path(__file__).resolve().parent.parent
RESULTS_ROOT = ROOT / "loadtest" / "results"
MODEL = "smollm2-135m-instruct"
MODEL_PATH = ".models/smollm2-135m-instruct"
PROMPT = "Hello World, what is your name dog?"
TARGETS = ("vllm-direct", "llmgate")


@dataclass
class Result:
    target: str
    requests_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    ok: int
    errors: int
    measured_s: float
    error_kinds: dict[str, int] = field(default_factory=dict)


# --- servers ---------------------------------------------------------------


@contextlib.contextmanager
def running_server(target: str, args: argparse.Namespace, log_path: Path) -> Iterator[str]:
    """Start ``target`` on free ports; yield its base URL once ready; stop it afterwards."""
    port = free_port()
    env = dict(os.environ)
    eager = ["--enforce-eager"] if args.enforce_eager else []
    if target == "vllm-direct":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # as the llmgate worker does
        module, ready_path = "vllm.entrypoints.openai.api_server", "/v1/models"
        flags = (
            f"--model {MODEL_PATH} --served-model-name {MODEL} --dtype float32"
            f" --host 127.0.0.1 --port {port}"
        )
    else:  # llmgate serve: embedded model, float32 and a 1 GiB KV cache by default
        module, ready_path = "worker.launcher", "/ready"
        flags = f"--port {port} --worker-base-port {free_port()}"
    argv = [sys.executable, "-m", module, *flags.split(), *eager]
    base_url = f"http://127.0.0.1:{port}"
    print(f"[{target}] starting (log: {log_path.relative_to(ROOT)})", flush=True)
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        started = time.monotonic()
        try:
            wait_ready(base_url + ready_path, args.startup_timeout, proc)
        except RuntimeError as exc:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"[{target}] {exc}; log tail:\n{tail}") from None
        print(f"[{target}] ready in {time.monotonic() - started:.0f}s", flush=True)
        yield base_url
    finally:
        print(f"[{target}] stopping", flush=True)
        stop_server(proc)


# --- load ------------------------------------------------------------------


async def run_load(target: str, base_url: str, args: argparse.Namespace) -> Result:
    """``args.users`` closed-loop clients; count what completes inside the window."""
    payload = {"model": MODEL, "prompt": PROMPT, "max_tokens": args.max_tokens}
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    start = time.perf_counter()
    window_start = start + args.warmup
    deadline = window_start + args.duration
    limits = httpx.Limits(max_connections=args.users, max_keepalive_connections=args.users)

    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=args.request_timeout
    ) as client:

        async def user() -> None:
            while (sent := time.perf_counter()) < deadline:
                try:
                    response = await client.post("/v1/completions", json=payload)
                    status = response.status_code
                    outcome = "ok" if status == 200 else f"HTTP {status}"
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                done = time.perf_counter()
                if not window_start <= done <= deadline:
                    continue  # warmup, or finished after the window closed
                if outcome == "ok":
                    latencies.append((done - sent) * 1000)
                else:
                    errors[outcome] += 1

        print(
            f"[{target}] {args.users} users: {args.warmup:g}s warmup + {args.duration:g}s measured",
            flush=True,
        )
        tasks = [asyncio.create_task(user()) for _ in range(args.users)]
        # Requests in flight at the deadline are not counted; let them finish
        # (a clean close for the server) but do not wait forever.
        _, pending = await asyncio.wait(tasks, timeout=deadline - start + 30)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    return Result(
        target=target,
        requests_per_s=len(latencies) / args.duration,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        ok=len(latencies),
        errors=sum(errors.values()),
        measured_s=args.duration,
        error_kinds=dict(errors),
    )


def measure(target: str, args: argparse.Namespace, run_dir: Path) -> Result:
    if target == "llmgate" and args.gateway_url:
        url = args.gateway_url.rstrip("/")
        wait_ready(url + "/ready", args.startup_timeout)
        return asyncio.run(run_load(target, url, args))
    with running_server(target, args, run_dir / f"{target}.log") as url:
        return asyncio.run(run_load(target, url, args))


# --- report ----------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_table(results: list[Result]) -> str:
    lines = [f"{'target':<13} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ok':>6} {'errors':>7}"]
    for r in results:
        lines.append(
            f"{r.target:<13} {r.requests_per_s:>8.2f} {_ms(r.p50_ms):>8} "
            f"{_ms(r.p99_ms):>8} {r.ok:>6} {r.errors:>7}"
        )
    ratio = throughput_ratio(results)
    if ratio is not None:
        lines.append(f"ratio llmgate/vllm-direct: {ratio:.2f}x")
    return "\n".join(lines)


def throughput_ratio(results: list[Result]) -> float | None:
    by_target = {r.target: r.requests_per_s for r in results}
    if "llmgate" in by_target and by_target.get("vllm-direct"):
        return by_target["llmgate"] / by_target["vllm-direct"]
    return None


def write_results(
    run_dir: Path, started: datetime, args: argparse.Namespace, results: list[Result]
) -> None:
    document = {
        "date": started.isoformat(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "vllm_version": vllm_version(),
        "model": MODEL,
        "parameters": {**vars(args), "prompt": PROMPT, "endpoint": "/v1/completions"},
        "results": [asdict(r) for r in results],
        "ratio_llmgate_over_vllm_direct": throughput_ratio(results),
    }
    (run_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    columns = ["target", "requests_per_s", "p50_ms", "p99_ms", "ok", "errors", "measured_s"]
    with (run_dir / "results.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_smoke",
        description="Seed scenario against vLLM's own server and llmgate, one after the other.",
    )
    parser.add_argument("--target", choices=["both", "vllm", "llmgate"], default="both")
    parser.add_argument("--users", type=int, default=40, help="concurrent closed-loop clients")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds not counted")
    parser.add_argument("--max-tokens", type=int, default=10)
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="pass --enforce-eager to both servers (quick start, no compile)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for a server to be ready",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="seconds one request may take before it counts as an error",
    )
    parser.add_argument(
        "--gateway-url",
        default=None,
        help="measure this running gateway instead of starting llmgate",
    )
    return parser


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.users < 1 or args.duration <= 0 or args.warmup < 0:
        raise SystemExit("--users must be >= 1, --duration > 0 and --warmup >= 0")
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the server is stopped.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    targets = {"both": list(TARGETS), "vllm": ["vllm-direct"], "llmgate": ["llmgate"]}
    started = datetime.now(UTC)
    run_dir = RESULTS_ROOT / f"{started:%Y%m%dT%H%M%SZ}-bench-smoke"
    run_dir.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    try:
        for target in targets[args.target]:
            results.append(measure(target, args, run_dir))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        if results:
            write_results(run_dir, started, args, results)
    print()
    print(format_table(results))
    print(f"\nresults: {run_dir.relative_to(ROOT)}/results.json")
    for r in results:
        if r.error_kinds:
            print(f"{r.target} errors: {r.error_kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
