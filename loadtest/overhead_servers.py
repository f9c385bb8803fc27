"""The servers the overhead harness measures, started pinned to their cores.

``direct`` is the zero-cost HTTP backend alone; ``vllm-router`` puts
vllm-router in front of it; ``llmgate`` is the gateway over one fake worker
(``loadtest.fake_engine``) on loopback TCP, ``llmgate-ipc`` the same over a
Unix socket, ``llmgate-baseline`` the same as ``llmgate`` from another
checkout (``--baseline``: the previous main, measured in the same run).
Every server stops when the caller's exit stack closes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from loadtest.pinning import CorePlan, pinned
from loadtest.procs import await_ready, healthy_workers, launched
from loadtest.report import ROOT
from loadtest.wrk import Target
from shared.ports import free_port

TARGETS = ("direct", "llmgate", "llmgate-ipc", "llmgate-baseline", "vllm-router")
# llmgate-ipc: the same gateway and worker over a Unix socket (``ipc://``)
# instead of loopback TCP; measured on request, not by default.
DEFAULT_TARGETS = ("direct", "llmgate", "vllm-router")
STARTUP_TIMEOUT = 60.0


def start_targets(
    stack: contextlib.ExitStack,
    names: Sequence[str],
    plan: CorePlan,
    out_dir: Path,
    router_bin: Path | None,
    baseline: Path | None = None,
) -> dict[str, Target]:
    """Start what ``names`` need, pinned per ``plan``; stopped when ``stack`` closes.
    ``baseline``: the checkout ``llmgate-baseline`` runs from."""
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
    if "llmgate-baseline" in names and baseline is not None:
        # Its own code on the path and as the working directory: its gateway
        # and its worker, with this virtualenv's libraries.
        old = {**env, "PYTHONPATH": str(baseline)}
        targets["llmgate-baseline"] = start_llmgate(
            stack, "llmgate-baseline", plan, out_dir, old, baseline
        )
    return targets


def fake_engine(root: Path) -> str:
    """The fake engine's module in the checkout at ``root`` (it lived in
    ``worker/`` before 2026-11-28)."""
    moved = not (root / "loadtest" / "fake_engine.py").exists()
    return "worker.fake_engine" if moved else "loadtest.fake_engine"


def start_llmgate(
    stack: contextlib.ExitStack,
    name: str,
    plan: CorePlan,
    out_dir: Path,
    env: dict[str, str],
    root: Path = ROOT,
) -> Target:
    """The gateway over one fake worker, linked by loopback TCP or a Unix socket,
    both run from the checkout at ``root``."""
    py = sys.executable
    if name.endswith("-ipc"):
        sockets = tempfile.mkdtemp(prefix="llmgate-overhead-")
        stack.callback(shutil.rmtree, sockets, ignore_errors=True)
        worker_address = f"ipc://{sockets}/worker.sock"
    else:
        worker_address = f"tcp://127.0.0.1:{free_port()}"
    suffix = name.removeprefix("llmgate")  # "", "-ipc" or "-baseline": names its logs
    log = out_dir / f"fake-worker{suffix}.log"
    argv = pinned(plan.backend, [py, "-m", fake_engine(root), "--bind", worker_address])
    worker = stack.enter_context(launched(f"fake-worker{suffix}", argv, log, env, root))
    port = free_port()
    log = out_dir / f"gateway{suffix}.log"
    argv = pinned(
        plan.proxy,
        [py, "-m", "gateway.main", "--workers", worker_address, "--port", str(port)],
    )
    gateway = stack.enter_context(launched(name, argv, log, env, root))
    url = f"http://127.0.0.1:{port}"
    await_ready(name, gateway, log, f"{url}/ready", STARTUP_TIMEOUT, healthy_workers(1))
    return Target(name, url, worker.pid, gateway.pid)
