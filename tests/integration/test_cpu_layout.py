"""CPU layouts as real engines take them: ``llmgate serve``'s default (every
core, none held back for vLLM's front end) is checked where a system of its
own starts (``tests/integration/test_launcher_processes.py``); here, the
session's worker, whose environment sets ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``
(``tests/conftest.py``), shows the environment winning over the default."""

from __future__ import annotations

import os
import re

from tests.conftest import Served


def vllm_binding(log: str) -> list[int]:
    """The cores vLLM's engine bound its compute threads to, from its log."""
    bound = re.search(r"core ids=\[([\d, ]+)\]", log)
    assert bound is not None, "vLLM's thread binding line is missing"
    return [int(c) for c in bound.group(1).split(",")]


def test_the_environment_wins_over_the_cpu_default(served: Served) -> None:
    cores = sorted(os.sched_getaffinity(0))
    served.wait_for_log(
        f"CPU layout, {len(cores)} usable cores: worker-0 on cores all {len(cores)} "
        "(reserved for its front end: 1)"
    )
    log = served.wait_for_log("reserve_cpu_num=1")
    assert vllm_binding(log) == cores[:-1]
