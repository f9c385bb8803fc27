"""Power of two choices: sample two workers at random, take the less loaded.

Picking the global minimum makes every gateway replica pile onto the same
worker between heartbeats (a herd on a stale signal); two random choices
spread the load almost as well and stay stable when the signal lags.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from gateway.dispatch.policies import RoutingContext, load

if TYPE_CHECKING:
    from gateway.dispatch.workers import Worker


class LeastLoad:
    uses_key = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, context: RoutingContext) -> Worker:
        candidates = context.candidates
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(list(candidates), 2)
        return first if load(first) <= load(second) else second
