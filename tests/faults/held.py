"""The fault tests' controllable double: ``loadtest.fake_engine`` with a gate.

A held worker (``--hold-after N``) sends each request's first ``N`` tokens,
then holds it until the test says ``release``: the request is still under
way when the test's fault lands, whatever the machine's speed. It runs the
real worker loop (the same ROUTER socket, heartbeats, gateway liveness and
aborts as ``llmgate worker``); only the engine is a double, and no test here
is about what a model answers (that is tests/integration/, on vLLM).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import zmq

from shared.ports import free_port
from tests.conftest import MODEL, ROOT, Served, start_gateway, stop_serve
from tests.integration.test_pool import metric

# Tokens a held request's choice makes in all (the first HOLD_AFTER at once).
TOKENS = 24
HOLD_AFTER = 2
BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": TOKENS}
# What keeps a stream on its worker (structured output: its grammar state is
# the engine's; the double ignores it): a stream that cannot move.
STAYS = {"structured_outputs": {"regex": "( fake)+"}}


@dataclass
class HeldWorker:
    proc: subprocess.Popen[bytes]
    address: str
    control: str
    log_path: Path

    def say(self, word: str) -> None:
        """``release``: held requests (and later ones) run to their end; ``hold``: hold again."""
        with zmq.Context.instance().socket(zmq.PUSH) as sock:
            # Delivered even to a worker slow to take it (a small share of a core).
            sock.setsockopt(zmq.LINGER, 60_000)
            sock.connect(self.control)
            sock.send(word.encode())
        self.wait_for_log(f"fake engine: {word}")

    def wait_for_log(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log_path.read_text(errors="replace"):
            if time.monotonic() > deadline:
                log = self.log_path.read_text(errors="replace")[-3000:]
                raise AssertionError(f"{text!r} not in the held worker's log in {timeout}s\n{log}")
            time.sleep(0.1)

    @property
    def process(self) -> psutil.Process:
        return psutil.Process(self.proc.pid)


@contextmanager
def held_worker(log_path: Path, *flags: str, name: str = "held-0") -> Iterator[HeldWorker]:
    """A held double worker on free loopback ports, logging at info."""
    address = f"tcp://127.0.0.1:{free_port()}"
    control = f"tcp://127.0.0.1:{free_port()}"
    argv = [
        *(sys.executable, "-m", "loadtest.fake_engine", "--bind", address, "--worker-id", name),
        *("--served-model-name", MODEL, "--hold-after", str(HOLD_AFTER), "--control", control),
        *("--log-level", "info", *flags),
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    worker = HeldWorker(proc, address, control, log_path)
    try:
        worker.wait_for_log("bound")
        yield worker
    finally:
        if proc.poll() is None:
            psutil.Process(proc.pid).resume()
            proc.kill()
        proc.wait()


@contextmanager
def gateway_over(log_path: Path, *workers: HeldWorker, flags: tuple[str, ...]) -> Iterator[Served]:
    gateway = start_gateway(log_path, ",".join(w.address for w in workers), *flags)
    try:
        yield gateway
    finally:
        stop_serve(gateway)


def running_at(gateway: Served, worker: HeldWorker) -> float:
    """Requests ``worker`` says it runs, as its heartbeats tell ``gateway``."""
    return metric(gateway.base_url, "llmgate_worker_requests_running", worker=worker.address) or 0


def http_client(gateway: Served) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=gateway.base_url, timeout=300, limits=httpx.Limits(max_connections=64)
    )
