"""One process ``llmgate serve`` starts and keeps: its command, environment and output.

Each child runs in its own process group, so stopping one also stops what
it spawned (vLLM's engine-core process). Its stderr (its log, argparse's
message, a traceback) comes through the launcher (``relay_output``), which
keeps its last lines for the message that ends serve when it exits at once;
stdout (vLLM's log) is the launcher's own.
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

from worker import rpc_dir

log = logging.getLogger("llmgate.launcher")

# What of a child's stderr the launcher keeps for the message that ends serve.
TAIL_BYTES = 16 * 1024
TAIL_LINES = 10
TAIL_LINE_CHARS = 500
# Flags whose values stay out of the log, which shows each child's command
# line (API keys never reach a log).
SECRET_FLAGS = ("--api-keys",)


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

    def start(self) -> None:
        log.info("starting %s: %s", self.name, " ".join(redacted(self.argv)))
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
    """``argv`` with the values of ``SECRET_FLAGS`` hidden."""
    out: list[str] = []
    for arg in argv:
        name, eq, _value = arg.partition("=")
        if out and out[-1] in SECRET_FLAGS:
            out.append("***")
        elif name in SECRET_FLAGS and eq:
            out.append(f"{name}=***")
        else:
            out.append(arg)
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
