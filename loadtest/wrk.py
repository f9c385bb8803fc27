"""One wrk run against a target, and what every process used during it.

A :class:`Scenario` is a request body and a number of connections; wrk runs
it for some seconds through a Lua script (:func:`wrk_script`) that prints
wrk's figures as one JSON line. :func:`run_wrk` measures the CPU seconds of
the proxy, the backend, wrk and the rest of the machine around that run,
and the proxy's memory, into a :class:`Run`.
"""

from __future__ import annotations

import contextlib
import json
import resource
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from loadtest.fake_engine import TOKEN_TEXT
from loadtest.pinning import CorePlan, pinned
from shared.settings import DEFAULT_MODEL_NAME

SCENARIO_NAMES = ("latency", "throughput", "stream")


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
