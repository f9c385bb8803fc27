"""Where the machine's cores went during a measured window, by kind of process.

A bench target's throughput is the engine's share of the cores: on a small
CPU machine every other process that runs (the load generator, an HTTP
server, a gateway, a worker's front end) takes time from the engine's
compute threads. Two snapshots of every process's CPU seconds, at the
window's start and end, say how many cores each kind used on average, and
how many sat idle; ``make bench`` prints them under its table.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import psutil

# (kind, substrings of a process's title or command line), first match wins.
# vLLM names its engine processes with setproctitle ("VLLM::EngineCore"); a
# process that matches none counts as its nearest ancestor that does (the
# engine's compute runs in a process it spawns with a bare command line).
KINDS = (
    ("vLLM engine", ("EngineCore", "VLLM::Worker")),
    ("llmgate worker", ("worker.main", "loadtest.fake_engine")),
    ("llmgate gateway", ("gateway.main",)),
    ("llmgate launcher", ("-m serve", "llmgate serve")),
    ("vLLM API server", ("vllm.entrypoints", "APIServer")),
    ("vllm-router", ("vllm-router", "vllm_router")),
    ("fastapi baseline", ("fastapi_batching",)),
)
CLIENT = "bench client"
OTHER = "other processes"
IDLE = "idle"


@dataclass(frozen=True)
class Snapshot:
    # pid -> (kind, CPU seconds so far: user + system, all its threads)
    processes: dict[int, tuple[str, float]]
    idle_s: float
    # When it was taken (time.perf_counter), so cores are per second actually between two.
    at: float


def kind_of(title: str, client_pid: int, pid: int) -> str:
    """A process's kind by its own title (``OTHER`` when none matches)."""
    if pid == client_pid:
        return CLIENT
    for kind, marks in KINDS:
        if any(mark in title for mark in marks):
            return kind
    return OTHER


def kinds_by_ancestry(processes: dict[int, tuple[str, int]], client_pid: int) -> dict[int, str]:
    """Each process's kind: by its title, else its nearest ancestor's (never the
    client's: what the client started is what is measured, not the client).

    ``processes``: pid -> (title, parent pid).
    """
    own = {pid: kind_of(title, client_pid, pid) for pid, (title, _) in processes.items()}
    kinds: dict[int, str] = {}
    for pid in processes:
        kind, seen, at = own[pid], {pid}, pid
        while kind == OTHER:
            at = processes[at][1]
            if at in seen or at not in processes or at == client_pid:
                break
            seen.add(at)
            kind = own[at]
        kinds[pid] = kind
    return kinds


def snapshot(client_pid: int | None = None) -> Snapshot:
    """Every process's CPU seconds now, with its kind; and the machine's idle seconds."""
    client_pid = os.getpid() if client_pid is None else client_pid
    found: dict[int, tuple[str, int]] = {}
    cpu: dict[int, float] = {}
    for proc in psutil.process_iter(["name", "cmdline", "ppid"]):
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            cpu[proc.pid] = times.user + times.system
            title = f"{proc.info['name'] or ''} {' '.join(proc.info['cmdline'] or ())}"
            found[proc.pid] = (title, proc.info["ppid"] or 0)
    kinds = kinds_by_ancestry(found, client_pid)
    idle_s = psutil.cpu_times().idle
    return Snapshot({pid: (kinds[pid], cpu[pid]) for pid in found}, idle_s, time.perf_counter())


def cores_by_kind(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """Mean cores each kind of process used between two snapshots, and idle ones.

    A process that started in between counts from zero; one that ended is
    left out (its last seconds cannot be read).
    """
    used: dict[str, float] = {}
    for pid, (kind, cpu_s) in after.processes.items():
        start = before.processes.get(pid, (kind, 0.0))[1]
        used[kind] = used.get(kind, 0.0) + max(0.0, cpu_s - start)
    seconds = after.at - before.at
    if seconds <= 0:
        return {}
    cores = {kind: round(s / seconds, 3) for kind, s in used.items()}
    cores[IDLE] = round(max(0.0, after.idle_s - before.idle_s) / seconds, 3)
    return dict(sorted(cores.items(), key=lambda item: -item[1]))


def format_cores(cores: dict[str, float]) -> str:
    return ", ".join(f"{kind} {value:.2f}" for kind, value in cores.items())
