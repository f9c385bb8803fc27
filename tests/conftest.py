"""Fixtures shared by the whole suite.

The integration tests share one real system per session: ``llmgate serve``
with one real vLLM CPU worker serving the embedded model (``--enforce-eager``
for a ~30 s start). It is started on free loopback ports the first time a
test asks for it, and stopped at the end of the session.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

MODEL = "smollm2-135m-instruct"
STARTUP_TIMEOUT = 300.0
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Served:
    """A running ``llmgate serve`` and where to reach it."""

    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def start_serve(log_path: Path, *extra: str, env: dict[str, str] | None = None) -> Served:
    """Start ``llmgate serve`` on free ports; return once the gateway is ready."""
    port = free_port()
    worker_port = free_port()
    argv = [
        sys.executable,
        "-m",
        "worker.launcher",
        "--port",
        str(port),
        "--worker-base-port",
        str(worker_port),
        "--enforce-eager",
        *extra,
    ]
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    served = Served(proc=proc, base_url=f"http://127.0.0.1:{port}", log_path=log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llmgate serve exited with {proc.returncode}:\n{served.log_tail()}")
        try:
            if httpx.get(f"{served.base_url}/ready", timeout=2).status_code == 200:
                return served
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_serve(served)
    raise RuntimeError(f"llmgate serve not ready after {STARTUP_TIMEOUT}s:\n{served.log_tail()}")


def stop_serve(served: Served, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
    if served.proc.poll() is None:
        served.proc.send_signal(sig)
    try:
        return served.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        return served.proc.wait()


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    running = start_serve(log_path)
    try:
        yield running
    finally:
        stop_serve(running)


@pytest.fixture(scope="session")
def base_url(served: Served) -> str:
    return served.base_url
