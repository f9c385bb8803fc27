"""One process ``llmgate serve`` starts and keeps: its command, environment and output.

Each child runs in its own process group, so stopping one also stops what
it spawned (vLLM's engine-core process). Its stderr (its log, argparse's
message, a traceback) comes through the launcher (``relay_output``), which
keeps its last lines for the message that ends serve when it fails its
start; stdout (vLLM's log) is the launcher's own. A child is ready once its
main process listens on its ``port`` (``check_ready``): the gateway's HTTP
port, a worker's ZeroMQ port, which it binds only once its engine has
started. The command line the launcher logs shows no secret (``redacted``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

import psutil

from shared.redact import redact_url
from worker import rpc_dir

log = logging.getLogger(__name__)

# What of a child's stderr the launcher keeps for the message that ends serve.
TAIL_BYTES = 16 * 1024
TAIL_LINES = 10
TAIL_LINE_CHARS = 500
# Flags whose values stay out of the log, which shows each child's command
# line. serve hands its own secrets over in the environment; these are what
# could still come in with the engine flags (vLLM's) or a hand-made Child.
SECRET_FLAGS = ("--api-keys", "--api-key", "--hf-token")


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0
    backoff: float = field(default=1.0)
    # A worker's vLLM IPC sockets go in a directory of its own, removed once
    # it exits (worker.rpc_dir).
    own_rpc_dir: bool = False
    rpc_dir: str | None = None
    # The end of the current process's stderr, and the thread copying it.
    tail: bytearray = field(default_factory=bytearray)
    relay: threading.Thread | None = None
    # The TCP port the child listens on once it serves (0: it never says).
    port: int = 0
    # Whether the current process has been ready, and whether any has.
    ready: bool = False
    ever_ready: bool = False
    # A worker: a rolling restart (SIGHUP) restarts it in turn.
    worker: bool = False

    def start(self) -> None:
        log.info("starting %s: %s", self.name, " ".join(redacted(self.argv)))
        self.ready = False
        env = dict(self.env)
        if self.own_rpc_dir:
            self.rpc_dir = rpc_dir.make(env, self.name)
        self.proc = subprocess.Popen(
            self.argv, env=env, start_new_session=True, stderr=subprocess.PIPE
        )
        self.started_at = time.monotonic()
        assert self.proc.stderr is not None
        self.tail = bytearray()
        self.relay = threading.Thread(
            target=relay_output,
            args=(self.proc.stderr, self.tail),
            name=f"relay-{self.name}",
            daemon=True,
        )
        self.relay.start()

    def check_ready(self) -> bool:
        """Whether the current process is, or has been, ready: its main process
        listens on ``port`` (the gateway: its app started, a worker: its engine).
        Only that process's sockets count: another program on the port, or a
        port vLLM's engine opens below a worker, does not make it ready."""
        if self.ready or self.proc is None or not self.port:
            return self.ready
        try:
            listening = psutil.Process(self.proc.pid).net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in listening):
            self.ready = self.ever_ready = True
            log.info(
                "%s is ready: it listens on port %d, %.0fs after its start",
                self.name,
                self.port,
                time.monotonic() - self.started_at,
            )
        return self.ready

    def last_lines(self, wait: float = 5.0) -> list[str]:
        """The last lines of the process's stderr, once it is copied through
        (its end, or ``wait`` seconds: a grandchild may hold the pipe open)."""
        if self.relay is not None:
            self.relay.join(wait)
        text = bytes(self.tail).decode(errors="replace")
        lines = [line.rstrip() for line in text.splitlines()]
        return [_clip(line) for line in lines if line.strip()][-TAIL_LINES:]

    def remove_rpc_dir(self) -> None:
        """Once it and its processes are gone."""
        rpc_dir.remove(self.rpc_dir)
        self.rpc_dir = None

    def signal(self, sig: int) -> None:
        """Signal the child's main process only (it drains, then stops its own children)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def redacted(argv: Sequence[str]) -> list[str]:
    """``argv`` with the values of ``SECRET_FLAGS`` hidden, and URLs' passwords."""
    out: list[str] = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if out and out[-1] in SECRET_FLAGS and not arg.startswith("--"):
            out.append("***")
        elif name in SECRET_FLAGS and eq:
            out.append(f"{name}=***")
        elif name.startswith("--") and eq:
            out.append(f"{name}={redact_url(value)}")
        else:
            out.append(redact_url(arg))
    return out


def relay_output(source: IO[bytes], tail: bytearray) -> None:
    """Copy a child's stderr to ours as it comes (progress bars too: chunks,
    not lines), keeping its last ``TAIL_BYTES`` in ``tail``."""
    out = getattr(sys.stderr, "buffer", None)
    fd = source.fileno()
    while chunk := os.read(fd, 65536):
        if out is not None:
            try:
                out.write(chunk)
                out.flush()
            except (OSError, ValueError):
                # Our stderr is gone (a closed pipe): keep draining the
                # child's, or it would block on its next write.
                out = None
        tail += chunk
        del tail[:-TAIL_BYTES]
    source.close()


def _clip(line: str) -> str:
    return line if len(line) <= TAIL_LINE_CHARS else line[: TAIL_LINE_CHARS - 3] + "..."
