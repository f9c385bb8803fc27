"""Which cores the processes of a measurement run on.

The proxy under test gets a core to itself whenever there are two or more;
the backends and the load generator share what is left (``plan_cores``).
Under root every measured process also runs at a raised priority.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Under root, every measured process runs at this niceness, so that whatever
# else runs on the machine disturbs the proxies (all alike) as little as it can.
NICENESS = -10


@dataclass(frozen=True)
class CorePlan:
    """Which cores the proxy under test, the backends and the load generator get."""

    proxy: tuple[int, ...]
    backend: tuple[int, ...]
    loadgen: tuple[int, ...]

    def describe(self) -> str:
        return (
            f"proxy (gateway or vllm-router) on cores {_cores(self.proxy)}; "
            f"backends (fake worker, zero-cost HTTP) on {_cores(self.backend)}; "
            f"wrk on {_cores(self.loadgen)}"
            + (f"; all at nice {NICENESS}" if os.geteuid() == 0 else "")
        )


def _cores(cores: Iterable[int]) -> str:
    return ",".join(map(str, cores))


def plan_cores(cores: Sequence[int]) -> CorePlan:
    """Give the proxy a core of its own whenever there are two or more.

    The proxy is what is measured, so it never shares; on 2 cores the
    backends and wrk share the other one, from 3 cores the backends get one
    to themselves, and wrk takes whatever is left.
    """
    ordered = tuple(sorted(cores))
    if not ordered:
        raise ValueError("no cores")
    if len(ordered) == 1:
        return CorePlan(ordered, ordered, ordered)
    proxy = ordered[-1:]
    if len(ordered) == 2:
        return CorePlan(proxy, ordered[:1], ordered[:1])
    return CorePlan(proxy, ordered[-2:-1], ordered[:-2])


# Under root, every measured process runs at this niceness, so that whatever


def pinned(cores: Sequence[int], argv: list[str]) -> list[str]:
    prefix = ["nice", "-n", str(NICENESS)] if os.geteuid() == 0 else []
    return [*prefix, "taskset", "-c", _cores(cores), *argv]
