"""``llmgate serve`` as processes: what runs, crash restart, and a clean stop.

Slow: starts its own system (and a second engine after the crash), so it
does not disturb the session's shared one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import MODEL, start_serve, stop_serve
from tests.integration.test_cpu_layout import vllm_binding

pytestmark = pytest.mark.slow


def children_by_role(launcher_pid: int) -> dict[str, psutil.Process]:
    roles = {}
    for child in psutil.Process(launcher_pid).children():
        cmdline = " ".join(child.cmdline())
        if "worker.main" in cmdline:
            roles["worker"] = child
        elif "gateway.main" in cmdline:
            roles["gateway"] = child
    return roles


def complete(base_url: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/completions",
        timeout=timeout,
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 3},
    )


def test_crashed_worker_is_restarted_and_stop_leaves_no_process(tmp_path: Path) -> None:
    served = start_serve(tmp_path / "serve.log")
    try:
        # The CPU default: one worker computing on every core, none held back
        # for vLLM's front end; the launcher logs it and vLLM's engine takes it.
        cores = sorted(os.sched_getaffinity(0))
        served.wait_for_log(
            f"CPU layout, {len(cores)} usable cores: worker-0 on cores all {len(cores)} "
            "(reserved for its front end: 0)"
        )
        assert vllm_binding(served.wait_for_log("reserve_cpu_num=0")) == cores
        launcher = psutil.Process(served.proc.pid)
        roles = children_by_role(launcher.pid)
        # One gateway and one worker; the worker runs vLLM's engine core below it.
        assert sorted(roles) == ["gateway", "worker"]
        assert len(launcher.children()) == 2
        assert roles["worker"].children(recursive=True), "no engine-core process"
        assert complete(served.base_url).status_code == 200

        old_worker = roles["worker"]
        # vLLM's IPC sockets are in a directory of the worker's own.
        old_rpc_dir = Path(old_worker.environ()["VLLM_RPC_BASE_PATH"])
        assert any(f.is_socket() for f in old_rpc_dir.iterdir()), list(old_rpc_dir.iterdir())
        old_worker.send_signal(signal.SIGKILL)
        # While the worker is gone nothing hangs: requests fail fast (a 503
        # after --startup-timeout, 5 s) or succeed. A hang would last
        # --request-timeout (600 s); the bound leaves room for a stalled machine.
        started = time.monotonic()
        during = complete(served.base_url, timeout=120)
        assert during.status_code in (200, 502, 503), during.text
        assert time.monotonic() - started < 60

        # The launcher starts a new worker, the gateway takes it in (new
        # incarnation), and requests succeed again without a gateway restart.
        gateway_pid = roles["gateway"].pid
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if complete(served.base_url).status_code == 200:
                break
            time.sleep(1)
        else:
            pytest.fail(f"no successful request after the restart:\n{served.log_tail()}")
        roles = children_by_role(launcher.pid)
        assert roles["worker"].pid != old_worker.pid
        assert roles["gateway"].pid == gateway_pid
        # The killed worker's sockets went with it; the new one has its own.
        assert not old_rpc_dir.exists()
        rpc_dir = Path(roles["worker"].environ()["VLLM_RPC_BASE_PATH"])
        assert rpc_dir != old_rpc_dir and rpc_dir.is_dir()

        everything = [launcher, *launcher.children(recursive=True)]
    except BaseException:
        stop_serve(served)
        raise

    # Ctrl-C stops it all, engine-core processes included, and exits 0.
    assert stop_serve(served, signal.SIGINT) == 0
    alive = []
    for proc in everything:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    assert not rpc_dir.exists(), list(rpc_dir.iterdir())
