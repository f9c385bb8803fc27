"""Starting and stopping the servers a benchmark measures, leaving nothing behind.

Each server starts in its own process group (``start_new_session``), its
output in a log file. :func:`stop_server` stops the whole tree: the group,
and every descendant listed *before* the signal, since ``llmgate serve``
puts each of its children in a process group of its own. SIGTERM (e.g. from
``timeout``) unwinds a bench like Ctrl-C (:func:`raise_interrupt`,
:func:`stop_on_signals`), so every server is stopped then too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import psutil

from shared.ports import free_port

STOP_GRACE_SECONDS = 30.0


def stop_server(proc: subprocess.Popen[bytes], grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after ``grace`` seconds."""
    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    try:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        psutil.wait_procs(procs, timeout=grace)
    except KeyboardInterrupt:
        print("interrupted again: killing the server now", file=sys.stderr)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for child in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()  # psutil checks the pid was not reused
        proc.wait()


ReadyCheck = Callable[[httpx.Response], bool]


def answers_200(response: httpx.Response) -> bool:
    return response.status_code == 200


def healthy_workers(count: int) -> ReadyCheck:
    """A gateway's ``/ready`` check: it answers and reports ``count`` healthy workers or more."""

    def check(response: httpx.Response) -> bool:
        return response.status_code == 200 and response.json()["healthy_workers"] >= count

    return check


def wait_ready(
    url: str,
    timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
    check: ReadyCheck = answers_200,
) -> None:
    """Poll ``url`` until ``check`` accepts its answer; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if check(httpx.get(url, timeout=2)):
                return
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s")


def log_tail(log_path: Path, lines: int = 30) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def launched(
    name: str,
    argv: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``argv`` in its own process group; stop it and its whole tree afterwards.

    It does not wait for readiness (:func:`await_ready`), so servers that
    make up one target can start side by side.
    """
    print(f"[{name}] starting (log: {log_path})", flush=True)
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        stop_server(proc)


def await_ready(
    name: str,
    proc: subprocess.Popen[bytes],
    log_path: Path,
    url: str,
    timeout: float,
    check: ReadyCheck = answers_200,
) -> None:
    """:func:`wait_ready`, with the server's log tail in the error."""
    started = time.monotonic()
    try:
        wait_ready(url, timeout, proc, check)
    except RuntimeError as exc:
        raise RuntimeError(f"[{name}] {exc}; log tail:\n{log_tail(log_path)}") from None
    print(f"[{name}] ready (waited {time.monotonic() - started:.0f}s)", flush=True)


def served_model(url: str, api_key: str | None = None) -> str:
    """The first model the server at ``url`` lists (asked with ``api_key``, if given)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url + "/v1/models", timeout=30, headers=headers)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    """A signal handler that unwinds like Ctrl-C."""
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM/SIGHUP end the run like Ctrl-C while inside, so every server is stopped."""
    previous = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def start_redis(run_dir: Path, stack: contextlib.ExitStack[Any]) -> str:
    """Debian's ``redis-server`` on a free port, no persistence, stopped with ``stack``; its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is missing: scripts/debian-package.sh redis-server installs it")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    stack.enter_context(launched("redis", argv, run_dir / "redis.log", cwd=run_dir))
    for _ in range(600):
        with contextlib.suppress(OSError):
            if "Ready to accept connections" in (run_dir / "redis.log").read_text():
                return f"redis://127.0.0.1:{port}/0"
        time.sleep(0.05)
    sys.exit("redis-server did not start: see redis.log")
