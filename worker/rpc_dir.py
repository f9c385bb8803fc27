"""A directory of one worker's own for vLLM's IPC sockets, removed when the worker is done.

vLLM's engine and its front end talk over ZeroMQ Unix sockets that it
creates in ``VLLM_RPC_BASE_PATH`` (the temp directory by default): seven per
engine start here, never removed, so every start, restart and crash left
files in /tmp. A worker's own directory goes with the worker: the launcher
removes its workers' once they exit, however they exit (a SIGKILL included),
and a worker started alone removes its own at exit.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import MutableMapping

ENV = "VLLM_RPC_BASE_PATH"


def make(env: MutableMapping[str, str], name: str) -> str | None:
    """Point ``env`` at a new private directory and return it; None, and
    ``env`` unchanged, when it names one already (the user's choice)."""
    if ENV in env:
        return None
    path = tempfile.mkdtemp(prefix=f"llmgate-{name}-")
    env[ENV] = path
    return path


def remove(path: str | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
