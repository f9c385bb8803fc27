"""Capacity and soak: the ``connections`` and ``soak`` scenarios of ``make loadtest``.

* ``connections``: ``--connections`` (1,000) streaming completions opened at
  once and held through the gateway, with the real engine behind it. The
  worker runs what its ``max_num_seqs`` allows; the gateway's admission queues
  the rest (``--max-queue`` is 1,024 by default). Every stream must end with
  ``[DONE]`` and its full token count: none refused, none cut, none hung.
  Reports how many completed, the time to first token and to the last
  stream's end, and the gateway's peak RSS and open file descriptors.
* ``soak``: hours of mixed load, memory sampled: ``loadtest.soak``, which
  uses the process sampling here.

Both write ``summary.json`` into the run's results directory. The load is on
loopback, bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import psutil

# Queued requests wait for a slot here rather than time out: the scenario is
# about holding connections, not about the default 30 s queue bound.
CONNECTIONS_QUEUE_TIMEOUT_S = 900


@dataclass
class StreamResult:
    status: int = 0
    tokens: int = 0
    done: bool = False
    error: str | None = None
    first_token_s: float | None = None
    seconds: float = 0.0


async def one_stream(
    client: httpx.AsyncClient, model: str, max_tokens: int, i: int, open_now: list[int]
) -> StreamResult:
    result = StreamResult()
    started = time.monotonic()
    body = {
        "model": model,
        "prompt": f"Connection {i}: once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    open_now[0] += 1
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:200]
                return result
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    result.done = True
                elif line.startswith("data: "):
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        result.error = payload["error"]["message"]
                    elif payload.get("usage") and not payload.get("choices"):
                        result.tokens = payload["usage"]["completion_tokens"]
                    elif result.first_token_s is None:
                        result.first_token_s = time.monotonic() - started
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    finally:
        open_now[0] -= 1
        result.seconds = time.monotonic() - started
    return result


@dataclass
class ProcessSample:
    at_s: float
    role: str
    pid: int
    rss_mb: float
    fds: int


def server_pid_of(url: str) -> int | None:
    """The pid of the ``llmgate serve`` on this machine that listens at ``url``, if any."""
    port = url.rstrip("/").rsplit(":", 1)[-1]
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "serve" in cmdline or any(a.endswith("llmgate") for a in cmdline[:2]):
            if "--port" in cmdline and cmdline[cmdline.index("--port") + 1] == port:
                return int(proc.pid)
    return None


def server_processes(
    server_pid: int | None, split_engine: bool = False
) -> dict[str, list[psutil.Process]]:
    """The processes of ``llmgate serve`` (pid ``server_pid``) by role, each with its
    children: the gateway (and its ``--processes``), each worker (and vLLM's engine;
    ``split_engine``: under ``worker/VLLM::...``, as vLLM names those processes)."""
    if server_pid is None:
        return {}
    roles: dict[str, list[psutil.Process]] = {"gateway": [], "worker": []}
    for proc in psutil.Process(server_pid).children():
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        for role in ("gateway", "worker"):
            if f"{role}.main" in cmdline:
                for label, family in process_family(role, proc, split_engine).items():
                    roles.setdefault(label, []).extend(family)
    return roles


def process_family(
    role: str, root: psutil.Process, split_engine: bool = False
) -> dict[str, list[psutil.Process]]:
    """``root`` and its descendants under ``role``; ``split_engine``: vLLM's engine
    processes (which name themselves ``VLLM::...``) under ``role/VLLM::...``."""
    out: dict[str, list[psutil.Process]] = {}
    try:
        family = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in family:
        label = role
        if split_engine:
            try:
                title = (proc.cmdline() or [""])[0]
            except psutil.Error:
                continue
            if title.startswith("VLLM::"):
                label = f"{role}/{title}"
        out.setdefault(label, []).append(proc)
    return out


def sample(roles: dict[str, list[psutil.Process]], at_s: float) -> list[ProcessSample]:
    out = []
    for role, processes in roles.items():
        for proc in processes:
            try:
                out.append(
                    ProcessSample(
                        at_s, role, proc.pid, proc.memory_info().rss / 2**20, proc.num_fds()
                    )
                )
            except psutil.Error:
                continue
    return out


def total(samples: list[ProcessSample], role: str, at_s: float) -> tuple[float, int]:
    rows = [s for s in samples if s.role == role and s.at_s == at_s]
    return sum(s.rss_mb for s in rows), sum(s.fds for s in rows)


def slope_mb_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per hour."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if not var:
        return None
    cov = sum((t - mean_t) * (m - mean_m) for t, m in points)
    return cov / var * 3600


async def connections(
    url: str, model: str, count: int, max_tokens: int, server_pid: int | None
) -> dict[str, object]:
    """``count`` streams at once; the outcome and what the gateway held meanwhile."""
    roles = server_processes(server_pid)
    open_now = [0]
    peak = {"open": 0, "gateway_rss_mb": 0.0, "gateway_fds": 0, "queue_depth": 0.0}
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        tasks = [
            asyncio.ensure_future(one_stream(client, model, max_tokens, i, open_now))
            for i in range(count)
        ]

        async def watch() -> None:
            while True:
                peak["open"] = max(peak["open"], open_now[0])
                rss, fds = total(sample(roles, 0.0), "gateway", 0.0)
                peak["gateway_rss_mb"] = max(peak["gateway_rss_mb"], rss)
                peak["gateway_fds"] = max(peak["gateway_fds"], fds)
                text = (await client.get("/metrics")).text
                for line in text.splitlines():
                    if line.startswith("llmgate_queue_depth "):
                        peak["queue_depth"] = max(peak["queue_depth"], float(line.split()[1]))
                await asyncio.sleep(1.0)

        watcher = asyncio.ensure_future(watch())
        results = await asyncio.gather(*tasks)
        watcher.cancel()
    wall = time.monotonic() - started
    whole = [r for r in results if r.done and r.error is None and r.tokens == max_tokens]
    ttft = sorted(r.first_token_s for r in results if r.first_token_s is not None)
    return {
        "scenario": "connections",
        "connections": count,
        "max_tokens": max_tokens,
        "completed_whole": len(whole),
        "statuses": dict(Counter(r.status for r in results)),
        "errors": dict(Counter(r.error for r in results if r.error)),
        "peak_open_connections": peak["open"],
        "peak_queue_depth": peak["queue_depth"],
        "peak_gateway_rss_mb": round(peak["gateway_rss_mb"], 1),
        "peak_gateway_fds": peak["gateway_fds"],
        "ttft_p50_s": round(ttft[len(ttft) // 2], 2) if ttft else None,
        "ttft_max_s": round(ttft[-1], 2) if ttft else None,
        "all_done_s": round(wall, 1),
        "longest_stream_s": round(max(r.seconds for r in results), 1),
    }


def format_report(report: dict[str, object]) -> str:
    return json.dumps(report, indent=2)
