"""``loadtest.pinning``: which cores the proxy, the backends and wrk get."""

from __future__ import annotations

import os

from loadtest import pinning
from loadtest.pinning import CorePlan


def test_one_core_is_shared_by_all() -> None:
    assert pinning.plan_cores([0]) == CorePlan((0,), (0,), (0,))


def test_two_cores_give_the_proxy_one_of_its_own() -> None:
    assert pinning.plan_cores([1, 0]) == CorePlan((1,), (0,), (0,))


def test_more_cores_separate_backend_and_load_generator() -> None:
    assert pinning.plan_cores([0, 1, 2]) == CorePlan((2,), (1,), (0,))
    assert pinning.plan_cores(range(8)) == CorePlan((7,), (6,), (0, 1, 2, 3, 4, 5))


def test_pinned_prefixes_taskset() -> None:
    argv = pinning.pinned((0, 2), ["wrk", "-c1"])
    assert argv[-5:] == ["taskset", "-c", "0,2", "wrk", "-c1"]
    if os.geteuid() == 0:  # root also raises the measured processes' priority
        assert argv[:3] == ["nice", "-n", str(pinning.NICENESS)]
