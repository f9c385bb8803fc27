"""Locust runs: what each run of ``make loadtest``'s Locust scenarios is, the
command line that runs it headless (or the web UI), and the figures read back
from the locustfile's summary (``--summary-json``)."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.report import ROOT

LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
SCENARIOS = ("seed", "chat-stream", "sweep")
# Locust's statistics name for each scenario's main request.
SEED_NAME = "/v1/completions"
CHAT_NAME = "/v1/chat/completions (stream)"


@dataclass(frozen=True)
class Run:
    """One Locust process: a scenario, or one step of the sweep."""

    name: str  # file prefix: seed, chat-stream, sweep-24, ...
    scenario: str
    user_class: str
    users: int
    warmup: float
    duration: float


@dataclass(frozen=True)
class Stats:
    """One row of Locust's ``<run>_stats.csv``; times in milliseconds."""

    name: str
    requests: int
    failures: int
    mean_ms: float
    p50_ms: float | None
    p99_ms: float | None


@dataclass(frozen=True)
class Summary:
    scenario: str
    run: str
    users: int
    requests: int
    failures: int
    requests_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    ttft_mean_ms: float | None = None
    itl_mean_ms: float | None = None
    window_s: float = 0.0  # the measured seconds the figures cover


# --- plan ------------------------------------------------------------------


def plan_runs(args: argparse.Namespace) -> list[Run]:
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    runs: list[Run] = []
    for scenario in scenarios:
        if scenario == "seed":
            runs.append(
                Run("seed", "seed", "SeedUser", args.seed_users, args.warmup, args.duration)
            )
        elif scenario == "chat-stream":
            runs.append(
                Run(
                    "chat-stream",
                    "chat-stream",
                    "ChatStreamUser",
                    args.chat_users,
                    args.warmup,
                    args.duration,
                )
            )
        else:
            runs.extend(
                Run(f"sweep-{u}", "sweep", "SeedUser", u, args.warmup, args.step_duration)
                for u in args.sweep_users
            )
    return runs


def planned_seconds(runs: Sequence[Run]) -> float:
    return sum(r.warmup + r.duration for r in runs)


def locust_argv(run: Run, host: str, prefix: Path, args: argparse.Namespace) -> list[str]:
    """The headless Locust command line for ``run``; reports go to ``prefix``*."""
    return [
        *_locust(host),
        "--headless",
        "--users",
        str(run.users),
        # Every user at once: a closed loop, not a ramp.
        "--spawn-rate",
        str(run.users),
        "--run-time",
        f"{round(run.warmup + run.duration)}s",
        "--warmup",
        f"{run.warmup:g}",
        "--csv",
        str(prefix),
        "--html",
        f"{prefix}.html",
        "--only-summary",
        # Failures are counted in the summary; they do not fail the run.
        "--exit-code-on-error",
        "0",
        "--summary-json",
        f"{prefix}_summary.json",
        *_scenario_options(args),
        run.user_class,
    ]


def web_argv(host: str, prefix: Path, args: argparse.Namespace) -> list[str]:
    return [
        *_locust(host),
        "--web-host",
        "127.0.0.1",
        "--web-port",
        str(args.web_port),
        "--class-picker",
        "--csv",
        str(prefix),
        "--html",
        f"{prefix}.html",
        *_scenario_options(args),
    ]


def _locust(host: str) -> list[str]:
    """Locust, our locustfile, and the server to load."""
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", host]


def _scenario_options(args: argparse.Namespace) -> list[str]:
    return [
        "--model",
        args.model,
        "--max-tokens",
        str(args.max_tokens),
        "--chat-max-tokens",
        str(args.chat_max_tokens),
    ]


# --- results ---------------------------------------------------------------


@dataclass(frozen=True)
class LocustSummary:
    """What the locustfile's ``--summary-json`` holds: the window and each request name."""

    window_s: float
    stats: dict[str, Stats]


def parse_locust_summary(text: str) -> LocustSummary:
    document = json.loads(text)
    stats = {
        entry["name"]: Stats(
            name=entry["name"],
            requests=int(entry["requests"]),
            failures=int(entry["failures"]),
            mean_ms=float(entry["mean_ms"]),
            p50_ms=entry["p50_ms"],
            p99_ms=entry["p99_ms"],
        )
        for entry in document["entries"]
    }
    return LocustSummary(window_s=float(document["window_s"]), stats=stats)


def summarize(run: Run, locust: LocustSummary) -> Summary:
    """The run's figures: throughput over the measured window, latency of the main request.

    ``requests_per_s`` counts only successes (a server that fails fast must
    not look fast); the percentiles, as Locust's, cover failures too.
    """
    main = locust.stats.get(CHAT_NAME if run.scenario == "chat-stream" else SEED_NAME)
    if main is None or locust.window_s <= 0:
        return Summary(run.scenario, run.name, run.users, 0, 0, 0.0, None, None)
    ttft, itl = locust.stats.get("TTFT"), locust.stats.get("ITL")
    return Summary(
        scenario=run.scenario,
        run=run.name,
        users=run.users,
        requests=main.requests,
        failures=main.failures,
        requests_per_s=(main.requests - main.failures) / locust.window_s,
        p50_ms=main.p50_ms,
        p99_ms=main.p99_ms,
        ttft_mean_ms=ttft.mean_ms if ttft and ttft.requests else None,
        itl_mean_ms=itl.mean_ms if itl and itl.requests else None,
        window_s=locust.window_s,
    )


# --- processes -------------------------------------------------------------


def stop_locust(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT, as Ctrl-C: Locust then writes its HTML report (not on SIGTERM); SIGKILL if stuck."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_locust(argv: list[str], log_path: Path, timeout: float) -> None:
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"locust still running after {timeout:.0f}s; see {log_path}") from None
    finally:
        stop_locust(proc)
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"locust exited with {rc}; log tail:\n{tail}")
