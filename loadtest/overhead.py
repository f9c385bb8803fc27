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
  loopback TCP.

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
import collections
import contextlib
import csv
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import psutil

from loadtest.fake_engine import TOKEN_TEXT
from loadtest.procs import await_ready, healthy_workers, launched
from shared.ports import free_port
from shared.settings import DEFAULT_MODEL_NAME

ROOT = Path(__file__).resolve().parent.parent
RESULTS_ROOT = ROOT / "loadtest" / "results"
TARGETS = ("direct", "llmgate", "llmgate-ipc", "vllm-router")
# llmgate-ipc: the same gateway and worker over a Unix socket (``ipc://``)
# instead of loopback TCP; measured on request, not by default.
DEFAULT_TARGETS = ("direct", "llmgate", "vllm-router")
SCENARIO_NAMES = ("latency", "throughput", "stream")
STARTUP_TIMEOUT = 60.0

# What issue 6 asks of the gateway.
TARGET_ADDED_LATENCY_US = 150.0
TARGET_RPS_VS_ROUTER = 0.5
TARGET_TOKENS_PER_CORE_S = 50_000.0


# --- pinning ---------------------------------------------------------------


@dataclass(frozen=True)
class CorePlan:
    """Which cores the proxy under test, the backends and the load generator get."""

    proxy: tuple[int, ...]
    backend: tuple[int, ...]
    loadgen: tuple[int, ...]

    def describe(self) -> str:
        return (
            f"proxy (gateway or vllm-router) on cores {_cores(self.proxy)}; "
            f"backends (fake worker, zero-cost HTTP) on {_cores(self.backend)}; "
            f"wrk on {_cores(self.loadgen)}"
            + (f"; all at nice {NICENESS}" if os.geteuid() == 0 else "")
        )


def _cores(cores: Iterable[int]) -> str:
    return ",".join(map(str, cores))


def plan_cores(cores: Sequence[int]) -> CorePlan:
    """Give the proxy a core of its own whenever there are two or more.

    The proxy is what is measured, so it never shares; on 2 cores the
    backends and wrk share the other one, from 3 cores the backends get one
    to themselves, and wrk takes whatever is left.
    """
    ordered = tuple(sorted(cores))
    if not ordered:
        raise ValueError("no cores")
    if len(ordered) == 1:
        return CorePlan(ordered, ordered, ordered)
    proxy = ordered[-1:]
    if len(ordered) == 2:
        return CorePlan(proxy, ordered[:1], ordered[:1])
    return CorePlan(proxy, ordered[-2:-1], ordered[:-2])


# Under root, every measured process runs at this niceness, so that whatever
# else runs on the machine disturbs the proxies (all alike) as little as it can.
NICENESS = -10


def pinned(cores: Sequence[int], argv: list[str]) -> list[str]:
    prefix = ["nice", "-n", str(NICENESS)] if os.geteuid() == 0 else []
    return [*prefix, "taskset", "-c", _cores(cores), *argv]


# --- wrk -------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    connections: int
    stream: bool
    tokens: int

    def body(self, model: str = DEFAULT_MODEL_NAME) -> bytes:
        payload = {
            "model": model,
            "prompt": "Hello World, what is your name dog?",
            "max_tokens": self.tokens,
            "stream": self.stream,
        }
        return json.dumps(payload, separators=(",", ":")).encode()


def scenarios(connections: int, stream_tokens: int) -> dict[str, Scenario]:
    return {
        "latency": Scenario("latency", 1, False, 1),
        "throughput": Scenario("throughput", connections, False, 1),
        "stream": Scenario("stream", connections, True, stream_tokens),
    }


WRK_MARKER = "WRK_JSON "

_WRK_DONE = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK_JSON {\"requests\":%d,\"duration_us\":%d,\"bytes\":%d,\"errors_connect\":%d," ..
    "\"errors_read\":%d,\"errors_write\":%d,\"errors_status\":%d,\"errors_timeout\":%d," ..
    "\"latency_mean_us\":%.3f,\"latency_stdev_us\":%.3f,\"latency_p50_us\":%d," ..
    "\"latency_p99_us\":%d,\"latency_max_us\":%d}\n",
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency.mean, latency.stdev, latency:percentile(50),
    latency:percentile(99), latency.max))
end
"""


def wrk_script(body: bytes) -> str:
    """A wrk Lua script that POSTs ``body`` as JSON and prints its figures as one JSON line."""
    text = body.decode()
    if "]==]" in text:
        raise ValueError("the body cannot hold a Lua long-bracket terminator")
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [==[{text}]==]\n" + _WRK_DONE
    )


def parse_wrk(output: str) -> dict[str, float]:
    """The figures the script's ``done`` printed."""
    for line in output.splitlines():
        if line.startswith(WRK_MARKER):
            figures: dict[str, float] = json.loads(line[len(WRK_MARKER) :])
            return figures
    raise ValueError(f"no {WRK_MARKER.strip()} line in wrk's output:\n{output}")


def wrk_errors(figures: dict[str, float]) -> int:
    return int(sum(v for k, v in figures.items() if k.startswith("errors_")))


# --- measuring processes ---------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants."""
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = p.cpu_times()
            total += times.user + times.system
    return total


def memory_kib(pid: int, field_name: str) -> int:
    """A ``/proc/PID/status`` memory field in KiB (``VmRSS``, ``VmHWM`` = peak RSS)."""
    return status_field(Path(f"/proc/{pid}/status").read_text(), field_name)


def status_field(status_text: str, field_name: str) -> int:
    for line in status_text.splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise ValueError(f"no {field_name} in /proc status")


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent running something (all cores)."""
    times = psutil.cpu_times()
    busy = ("user", "nice", "system", "irq", "softirq")
    return float(sum(getattr(times, name, 0.0) for name in busy))


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --- one run ---------------------------------------------------------------


@dataclass
class Run:
    target: str
    scenario: str
    repeat: int
    connections: int
    tokens_per_request: int
    seconds: float
    requests: int
    errors: int
    requests_per_s: float
    tokens_per_s: float
    latency_mean_us: float
    latency_p50_us: float
    latency_p99_us: float
    latency_max_us: float
    loadgen_cpu_util: float
    backend_cpu_util: float
    # Busy core-seconds per second outside the proxy, the backend and wrk: idle
    # servers, the kernel's network work, and anything else running on the machine.
    other_cpu_util: float
    # The proxy's figures; None for ``direct``.
    proxy_cpu_util: float | None = None
    requests_per_proxy_core_s: float | None = None
    tokens_per_proxy_core_s: float | None = None
    proxy_cpu_s_per_1k_requests: float | None = None
    proxy_rss_mib: float | None = None
    proxy_peak_rss_mib: float | None = None


@dataclass
class Target:
    name: str
    url: str
    backend_pid: int
    proxy_pid: int | None = None


def run_wrk(
    target: Target,
    scenario: Scenario,
    seconds: int,
    plan: CorePlan,
    script: Path,
    repeat: int,
) -> Run:
    argv = pinned(
        plan.loadgen,
        [
            *("wrk", "-t", str(min(len(plan.loadgen), scenario.connections))),
            *("-c", str(scenario.connections), "-d", f"{seconds}s", "--timeout", "10s"),
            *("-s", str(script), f"{target.url}/v1/completions"),
        ],
    )
    proxy_before = cpu_seconds(target.proxy_pid) if target.proxy_pid else 0.0
    backend_before = cpu_seconds(target.backend_pid)
    loadgen_before = children_cpu_seconds()
    machine_before = busy_cpu_seconds()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    machine_busy = busy_cpu_seconds() - machine_before
    loadgen_cpu = children_cpu_seconds() - loadgen_before
    backend_cpu = cpu_seconds(target.backend_pid) - backend_before
    proxy_cpu = cpu_seconds(target.proxy_pid) - proxy_before if target.proxy_pid else 0.0
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr}{done.stdout}")
    figures = parse_wrk(done.stdout)
    measured = figures["duration_us"] / 1e6
    requests = int(figures["requests"])
    tokens = requests * scenario.tokens
    run = Run(
        target=target.name,
        scenario=scenario.name,
        repeat=repeat,
        connections=scenario.connections,
        tokens_per_request=scenario.tokens,
        seconds=measured,
        requests=requests,
        errors=wrk_errors(figures),
        requests_per_s=requests / measured,
        tokens_per_s=tokens / measured if scenario.stream else 0.0,
        latency_mean_us=figures["latency_mean_us"],
        latency_p50_us=figures["latency_p50_us"],
        latency_p99_us=figures["latency_p99_us"],
        latency_max_us=figures["latency_max_us"],
        loadgen_cpu_util=loadgen_cpu / measured,
        backend_cpu_util=backend_cpu / measured,
        other_cpu_util=max(machine_busy - proxy_cpu - backend_cpu - loadgen_cpu, 0.0) / measured,
    )
    if target.proxy_pid:
        run.proxy_cpu_util = proxy_cpu / measured
        run.requests_per_proxy_core_s = requests / proxy_cpu if proxy_cpu else None
        if scenario.stream:
            run.tokens_per_proxy_core_s = tokens / proxy_cpu if proxy_cpu else None
        run.proxy_cpu_s_per_1k_requests = proxy_cpu / requests * 1000 if requests else None
        run.proxy_rss_mib = memory_kib(target.proxy_pid, "VmRSS") / 1024
        run.proxy_peak_rss_mib = memory_kib(target.proxy_pid, "VmHWM") / 1024
    return run


def check_answer(url: str, scenario: Scenario) -> None:
    """One request by hand: the target answers this scenario correctly, token for token."""
    response = httpx.post(
        f"{url}/v1/completions",
        content=scenario.body(),
        headers={"content-type": "application/json"},
        timeout=10,
    )
    if response.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
    if scenario.stream:
        events = [
            line[len("data: ") :]
            for line in response.text.splitlines()
            if line.startswith("data: ")
        ]
        text = "".join(
            choice.get("text", "")
            for event in events[:-1]
            for choice in json.loads(event)["choices"]
        )
        complete = events[-1:] == ["[DONE]"]
    else:
        text = response.json()["choices"][0]["text"]
        complete = True
    if text != TOKEN_TEXT * scenario.tokens or not complete:
        raise RuntimeError(f"{url}: unexpected answer for {scenario.name}: {response.text[:300]}")


# --- summary ---------------------------------------------------------------

SUMMARY_METRICS = (
    "requests_per_s",
    "tokens_per_s",
    "latency_mean_us",
    "latency_p50_us",
    "latency_p99_us",
    "added_latency_us",
    "proxy_cpu_util",
    "requests_per_proxy_core_s",
    "tokens_per_proxy_core_s",
    "proxy_cpu_s_per_1k_requests",
    "proxy_peak_rss_mib",
    "backend_cpu_util",
    "loadgen_cpu_util",
    "other_cpu_util",
)


def added_latency(runs: Sequence[Run]) -> dict[tuple[str, int], float]:
    """(proxy, repeat) -> its mean latency minus ``direct``'s, latency scenario, same repeat."""
    direct = {
        r.repeat: r.latency_mean_us
        for r in runs
        if r.scenario == "latency" and r.target == "direct"
    }
    return {
        (r.target, r.repeat): r.latency_mean_us - direct[r.repeat]
        for r in runs
        if r.scenario == "latency" and r.target != "direct" and r.repeat in direct
    }


@dataclass
class Spread:
    min: float
    median: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(min(values), statistics.median(values), max(values), len(values))


def summarize(runs: Sequence[Run]) -> dict[tuple[str, str], dict[str, Spread]]:
    """(scenario, target) -> metric -> min/median/max over the repeats."""
    values: dict[tuple[str, str], dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    extra = added_latency(runs)
    for run in runs:
        row = asdict(run)
        row["added_latency_us"] = (
            extra.get((run.target, run.repeat)) if run.scenario == "latency" else None
        )
        for metric in SUMMARY_METRICS:
            value = row[metric]
            if value is not None and not (metric == "tokens_per_s" and run.scenario != "stream"):
                values[(run.scenario, run.target)][metric].append(float(value))
    return {key: {m: Spread.of(v) for m, v in by.items()} for key, by in values.items()}


@dataclass
class Verdict:
    name: str
    target: str
    measured: float | None
    passed: bool | None
    note: str = ""


def verdicts(summary: dict[tuple[str, str], dict[str, Spread]]) -> list[Verdict]:
    """The issue's three gateway targets, judged on medians."""

    def median(scenario: str, target: str, metric: str) -> float | None:
        spread = summary.get((scenario, target), {}).get(metric)
        return spread.median if spread else None

    out = []
    added = median("latency", "llmgate", "added_latency_us")
    router_added = median("latency", "vllm-router", "added_latency_us")
    out.append(
        Verdict(
            "added latency at concurrency 1 (us)",
            f"<= {TARGET_ADDED_LATENCY_US:.0f}",
            added,
            None if added is None else added <= TARGET_ADDED_LATENCY_US,
            "" if router_added is None else f"vllm-router adds {router_added:.0f}",
        )
    )
    for metric, label in (
        ("requests_per_s", "requests/s vs vllm-router"),
        ("requests_per_proxy_core_s", "requests per proxy core-second vs vllm-router"),
    ):
        ours = median("throughput", "llmgate", metric)
        theirs = median("throughput", "vllm-router", metric)
        ratio = ours / theirs if ours is not None and theirs else None
        out.append(
            Verdict(
                label,
                f">= {TARGET_RPS_VS_ROUTER:g}x",
                ratio,
                None if ratio is None else ratio >= TARGET_RPS_VS_ROUTER,
                "" if ours is None or theirs is None else f"{ours:.0f} vs {theirs:.0f}",
            )
        )
    tokens = median("stream", "llmgate", "tokens_per_proxy_core_s")
    router_tokens = median("stream", "vllm-router", "tokens_per_proxy_core_s")
    out.append(
        Verdict(
            "streamed tokens per gateway core-second",
            f">= {TARGET_TOKENS_PER_CORE_S:.0f}",
            tokens,
            None if tokens is None else tokens >= TARGET_TOKENS_PER_CORE_S,
            "" if router_tokens is None else f"vllm-router: {router_tokens:.0f}",
        )
    )
    return out


def _fmt(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_spread(spread: Spread | None) -> str:
    if spread is None:
        return "-"
    return f"{_fmt(spread.median)} [{_fmt(spread.min)}-{_fmt(spread.max)}]"


TABLE_ROWS = (
    ("requests/s", "requests_per_s"),
    ("streamed tokens/s", "tokens_per_s"),
    ("latency mean (us)", "latency_mean_us"),
    ("added latency (us)", "added_latency_us"),
    ("latency p50 (us)", "latency_p50_us"),
    ("latency p99 (us)", "latency_p99_us"),
    ("proxy CPU (cores)", "proxy_cpu_util"),
    ("requests per proxy core-s", "requests_per_proxy_core_s"),
    ("tokens per proxy core-s", "tokens_per_proxy_core_s"),
    ("proxy CPU s per 1k requests", "proxy_cpu_s_per_1k_requests"),
    ("proxy peak RSS (MiB)", "proxy_peak_rss_mib"),
    ("backend CPU (cores)", "backend_cpu_util"),
    ("wrk CPU (cores)", "loadgen_cpu_util"),
    ("other CPU (cores)", "other_cpu_util"),
)


def format_table(summary: dict[tuple[str, str], dict[str, Spread]]) -> str:
    """A block per scenario: a row per metric, a column per target; cells median [min-max]."""
    blocks = []
    for scenario in SCENARIO_NAMES:
        present = [t for t in TARGETS if (scenario, t) in summary]
        if not present:
            continue
        rows = [[scenario, *present]]
        for label, metric in TABLE_ROWS:
            cells = [format_spread(summary[(scenario, t)].get(metric)) for t in present]
            if any(cell != "-" for cell in cells):
                rows.append([f"  {label}", *cells])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        blocks.append(
            "\n".join(
                "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
                for r in rows
            )
        )
    return "\n\n".join(blocks)


def format_verdicts(items: Sequence[Verdict]) -> str:
    lines = []
    for v in items:
        state = "n/a" if v.passed is None else ("PASS" if v.passed else "MISS")
        shown = "-" if v.measured is None else _fmt(v.measured)
        note = f"  ({v.note})" if v.note else ""
        lines.append(f"{state:4}  {v.name}: {shown} (target {v.target}){note}")
    return "\n".join(lines)


# --- profiles --------------------------------------------------------------


def _stacks(collapsed: str) -> Iterator[tuple[str, int]]:
    """(stack, samples) of each well-formed line of py-spy's raw output."""
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack, int(count)


def top_frames(collapsed: str, limit: int = 15) -> tuple[list[tuple[str, float]], int]:
    """Self time per frame from py-spy's raw (collapsed-stack) output: (frame, share), samples.

    Each line is ``frame;frame;...;leaf COUNT``; the leaf holds the sample.
    """
    self_counts: collections.Counter[str] = collections.Counter()
    total = 0
    for stack, samples in _stacks(collapsed):
        total += samples
        self_counts[stack.rsplit(";", 1)[-1]] += samples
    return [(frame, n / total) for frame, n in self_counts.most_common(limit)], total


def inclusive_by_file(collapsed: str, limit: int = 15) -> list[tuple[str, float]]:
    """Share of samples whose stack passes through each source file (counted once a stack)."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for stack, samples in _stacks(collapsed):
        total += samples
        for source in {_frame_file(frame) for frame in stack.split(";")}:
            counts[source] += samples
    return [(source, n / total) for source, n in counts.most_common(limit)] if total else []


def self_by_component(collapsed: str) -> list[tuple[str, float]]:
    """Self time summed per component: our files one by one, other code per package.

    Shares add up to 1, so this says where a core's time goes. A frame that
    calls into C (a socket send, uvloop's loop) holds the time spent there.
    """
    counts: collections.Counter[str] = collections.Counter()
    for frame, share in top_frames(collapsed, limit=1_000_000)[0]:
        counts[_component(_frame_file(frame))] += share  # type: ignore[assignment]
    return sorted(counts.items(), key=lambda kv: -kv[1])


def _component(path: str) -> str:
    if path.startswith(("gateway/", "shared/", "worker/")):
        return path
    if path == "asyncio/runners.py":
        return "event loop (uvloop, in C)"
    head = path.split("/", 1)[0]
    return head.removesuffix(".py").removeprefix("<frozen ").removesuffix(">")


def _frame_file(frame: str) -> str:
    # py-spy frames read "function (path/to/file.py:line)".
    inside = frame.rpartition("(")[2].rstrip(")")
    path = inside.rsplit(":", 1)[0]
    marker = "site-packages/"
    return path.split(marker, 1)[1] if marker in path else path


# --- the whole run ---------------------------------------------------------


def versions(router_bin: Path | None) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("llmgate", "fastapi", "starlette", "uvicorn", "uvloop", "httptools", "pyzmq"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    out["msgspec"] = importlib.metadata.version("msgspec")
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


def machine(cores: Sequence[int]) -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "cores": list(cores),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
    }


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM/SIGHUP end the run like Ctrl-C, so every server is stopped."""

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def start_targets(
    stack: contextlib.ExitStack,
    names: Sequence[str],
    plan: CorePlan,
    out_dir: Path,
    router_bin: Path | None,
) -> dict[str, Target]:
    """Start what ``names`` need, pinned per ``plan``; stopped when ``stack`` closes."""
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    targets: dict[str, Target] = {}
    if "direct" in names or "vllm-router" in names:
        port = free_port()
        log = out_dir / "zero-cost-http.log"
        argv = pinned(plan.backend, [py, "-m", "loadtest.zero_cost_http", "--port", str(port)])
        backend = stack.enter_context(launched("zero-cost-http", argv, log, env, ROOT))
        backend_url = f"http://127.0.0.1:{port}"
        await_ready("zero-cost-http", backend, log, f"{backend_url}/health", STARTUP_TIMEOUT)
        if "direct" in names:
            targets["direct"] = Target("direct", backend_url, backend.pid)
        if "vllm-router" in names and router_bin is not None:
            port = free_port()
            log = out_dir / "vllm-router.log"
            argv = pinned(
                plan.proxy,
                [
                    *(str(router_bin), "--port", str(port), "--worker-urls", backend_url),
                    # Its cheapest policy, and no per-request log lines (nor has the gateway).
                    *("--policy", "round_robin", "--log-level", "warning"),
                ],
            )
            router = stack.enter_context(launched("vllm-router", argv, log, env, ROOT))
            url = f"http://127.0.0.1:{port}"
            await_ready("vllm-router", router, log, f"{url}/v1/models", STARTUP_TIMEOUT)
            targets["vllm-router"] = Target("vllm-router", url, backend.pid, router.pid)
    for name in ("llmgate", "llmgate-ipc"):
        if name in names:
            targets[name] = start_llmgate(stack, name, plan, out_dir, env)
    return targets


def start_llmgate(
    stack: contextlib.ExitStack,
    name: str,
    plan: CorePlan,
    out_dir: Path,
    env: dict[str, str],
) -> Target:
    """The gateway over one fake worker, linked by loopback TCP or a Unix socket."""
    py = sys.executable
    if name.endswith("-ipc"):
        sockets = tempfile.mkdtemp(prefix="llmgate-overhead-")
        stack.callback(shutil.rmtree, sockets, ignore_errors=True)
        worker_address = f"ipc://{sockets}/worker.sock"
    else:
        worker_address = f"tcp://127.0.0.1:{free_port()}"
    suffix = name.removeprefix("llmgate")  # "" or "-ipc": names its logs
    log = out_dir / f"fake-worker{suffix}.log"
    argv = pinned(plan.backend, [py, "-m", "loadtest.fake_engine", "--bind", worker_address])
    worker = stack.enter_context(launched(f"fake-worker{suffix}", argv, log, env, ROOT))
    port = free_port()
    log = out_dir / f"gateway{suffix}.log"
    argv = pinned(
        plan.proxy,
        [py, "-m", "gateway.main", "--workers", worker_address, "--port", str(port)],
    )
    gateway = stack.enter_context(launched(name, argv, log, env, ROOT))
    url = f"http://127.0.0.1:{port}"
    await_ready(name, gateway, log, f"{url}/ready", STARTUP_TIMEOUT, healthy_workers(1))
    return Target(name, url, worker.pid, gateway.pid)


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


def profile_gateway(
    target: Target,
    chosen: Sequence[Scenario],
    args: argparse.Namespace,
    plan: CorePlan,
    out_dir: Path,
) -> dict[str, Any]:
    """One extra run per loaded scenario with py-spy sampling the gateway and
    the worker around the fake engine at once (not counted)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy not found (`.venv/bin/pip install py-spy`): no profile", flush=True)
        return {}
    assert target.proxy_pid is not None
    sampled = {"gateway": target.proxy_pid, "worker": target.backend_pid}
    profiles: dict[str, Any] = {}
    for scenario in chosen:
        raws = {who: out_dir / f"profile-{who}-{scenario.name}.txt" for who in sampled}
        spies = [
            subprocess.Popen(
                pinned(
                    plan.loadgen,
                    [
                        *(py_spy, "record", "--pid", str(pid), "--rate", "250"),
                        *("--duration", str(args.duration), "--nonblocking"),
                        *("--format", "raw", "--output", str(raws[who])),
                    ],
                ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for who, pid in sampled.items()
        ]
        try:
            time.sleep(0.5)  # py-spy attaches
            script = out_dir / f"wrk-{scenario.name}.lua"
            run = run_wrk(target, scenario, args.duration, plan, script, 0)
        finally:
            for spy in spies:
                spy.wait(timeout=args.duration + 30)
        for who, raw in raws.items():
            if not raw.exists():
                continue
            collapsed = raw.read_text()
            frames, samples = top_frames(collapsed)
            files = inclusive_by_file(collapsed)
            components = self_by_component(collapsed)
            # The gateway's profiles keep their old keys (the scenario's name).
            key = scenario.name if who == "gateway" else f"{who}-{scenario.name}"
            profiles[key] = {
                "file": raw.name,
                "samples": samples,
                "requests_per_s_while_sampled": run.requests_per_s,
                "self": frames,
                "self_by_component": components,
                "inclusive_by_file": files,
            }
            print(f"\n{who} profile, {scenario.name} ({samples} samples, {raw.name}):")
            print("  self time:")
            for frame, share in frames[:12]:
                print(f"    {share:6.1%}  {frame}")
            print("  self time by component:")
            for component, share in components[:14]:
                print(f"    {share:6.1%}  {component}")
    return profiles


def write_results(out_dir: Path, runs: Sequence[Run], report: dict[str, Any]) -> None:
    if runs:
        with (out_dir / "runs.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(asdict(runs[0])))
            writer.writeheader()
            writer.writerows(asdict(r) for r in runs)
    with (out_dir / "summary.csv").open("w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["scenario", "target", "metric", "min", "median", "max", "n"])
        for entry in report["summary"]:
            rows.writerow(
                [entry[k] for k in ("scenario", "target", "metric", "min", "median", "max", "n")]
            )
    (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")


def _ensure_router() -> Path:
    # make bench's: one virtualenv for both, created under a lock on first use.
    from loadtest.targets import ensure_router

    return ensure_router()


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
    parser.add_argument("--results-dir", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    names = [t for t in args.targets.split(",") if t]
    wanted = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(names) - set(TARGETS)) + sorted(set(wanted) - set(SCENARIO_NAMES))
    if unknown or args.repeats < 1:
        raise SystemExit(f"unknown target or scenario {unknown}, or --repeats < 1")
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: `apt-get install wrk` (Debian/Ubuntu)")
    router_bin: Path | None = None
    if "vllm-router" in names:
        router_bin = args.router_bin or _ensure_router()
    cores = sorted(os.sched_getaffinity(0))
    plan = plan_cores(cores)
    # This script only waits on wrk; it stays off the proxy's core.
    os.sched_setaffinity(0, plan.loadgen)
    all_scenarios = scenarios(args.connections, args.stream_tokens)
    chosen = [all_scenarios[name] for name in SCENARIO_NAMES if name in wanted]
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = args.results_dir or RESULTS_ROOT / f"{stamp}-overhead"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"pinning: {plan.describe()}", flush=True)
    print(f"results: {out_dir}", flush=True)
    runs: list[Run] = []
    profiles: dict[str, Any] = {}
    with _stop_on_signals(), contextlib.ExitStack() as stack:
        targets = start_targets(stack, names, plan, out_dir, router_bin)
        runs = measure(targets, chosen, args, plan, out_dir)
        if args.profile and "llmgate" in targets:
            profiles = profile_gateway(targets["llmgate"], chosen, args, plan, out_dir)
    summary = summarize(runs)
    judged = verdicts(summary)
    report = {
        "started": stamp,
        "machine": machine(cores),
        "versions": versions(router_bin),
        "pinning": {**asdict(plan), "description": plan.describe()},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "scenarios": [asdict(s) for s in chosen],
        "runs": [asdict(r) for r in runs],
        "summary": [
            {"scenario": s, "target": t, "metric": m, **asdict(spread)}
            for (s, t), by in sorted(summary.items())
            for m, spread in by.items()
        ],
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
