"""A vLLM general plugin (entry point ``vllm.general_plugins``): how long
vLLM's processes busy-wait for each other.

vLLM's engine core and its model runner are separate processes that hand
each step over through shared memory. A reader that has read within the last
second does not sleep for the next message: it spins on ``sched_yield``
(``SpinCondition.busy_loop_s``, 1 s, not configurable in vLLM 0.32). Under
load the next message always comes within the second, so the engine core
spins for as long as the model runner computes: on a GPU a core nobody
misses, on a CPU engine a core taken from the model, the gateway and
everything else on the machine. ``LLMGATE_ENGINE_BUSY_WAIT`` (seconds) caps
that window; the worker sets it for a CPU engine (``worker.main``), and vLLM
runs this plugin in each of its processes, spawned ones too.
"""

from __future__ import annotations

import logging
import os
from typing import Any

ENV = "LLMGATE_ENGINE_BUSY_WAIT"
# The entry point's name (pyproject.toml), as VLLM_PLUGINS would list it.
NAME = "llmgate_busy_wait"

log = logging.getLogger(__name__)


def busy_wait_seconds(environ: dict[str, str] | os._Environ[str]) -> float | None:
    """The cap the environment asks for, or None: vLLM's own window (unset,
    or not a number of seconds, which the worker refuses before it gets here)."""
    value = environ.get(ENV, "").strip()
    try:
        seconds = float(value) if value else None
    except ValueError:
        seconds = -1.0
    if seconds is not None and not seconds >= 0:
        log.warning("%s=%r is not a number of seconds: vLLM's own busy wait is kept", ENV, value)
        return None
    return seconds


def register() -> None:
    seconds = busy_wait_seconds(os.environ)
    if seconds is None:
        return
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    original_wait = getattr(SpinCondition.wait, "llmgate_original", SpinCondition.wait)

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        # Readers only (a writer's window is 0); a reader made before this
        # plugin ran gets the cap at its first wait.
        if self.busy_loop_s > seconds:
            self.busy_loop_s = seconds
        original_wait(self, timeout_ms)

    wait.llmgate_original = original_wait  # type: ignore[attr-defined]
    SpinCondition.wait = wait  # type: ignore[method-assign]
