"""Each eligible worker in turn."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from gateway.dispatch.policies import RoutingContext

if TYPE_CHECKING:
    from gateway.dispatch.workers import Worker


class RoundRobin:
    uses_key = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, context: RoutingContext) -> Worker:
        return context.candidates[next(self._counter) % len(context.candidates)]
