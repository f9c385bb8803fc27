"""``llmgate serve``'s CPU default, as the session's real worker runs it: one
worker computing on every usable core, none held back for vLLM's front end."""

from __future__ import annotations

import os
import re

from tests.conftest import Served


def test_the_lone_cpu_worker_computes_on_every_core(served: Served) -> None:
    cores = sorted(os.sched_getaffinity(0))
    served.wait_for_log(
        f"CPU layout, {len(cores)} usable cores: worker-0 on cores all {len(cores)} "
        "(reserved for its front end: 0)"
    )
    # And vLLM took it: its engine binds one compute thread per core, none reserved.
    log = served.wait_for_log("reserve_cpu_num=0")
    bound = re.search(r"core ids=\[([\d, ]+)\]", log)
    assert bound is not None, "vLLM's thread binding line is missing"
    assert [int(c) for c in bound.group(1).split(",")] == cores
