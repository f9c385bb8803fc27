"""Prefix affinity: rendezvous hashing with bounded load.

Requests with the same key (a session key, else the start of the prompt)
rank the workers the same way: by a hash of (key, worker). The first worker
in that ranking whose load stays within ``load_factor`` times the mean gets
the request, so one hot prefix cannot overload a worker (consistent hashing
with bounded loads, Mirrokni et al. 2018). Adding or removing a worker only
moves the keys that ranked it first. Nothing is stored per key.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

from gateway.policies import RoutingContext, load
from gateway.policies.least_load import LeastLoad

if TYPE_CHECKING:
    from gateway.workers import WorkerState


def score(key: str, worker_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PrefixAffinity:
    uses_key = True

    def __init__(self, load_factor: float = 1.25) -> None:
        if load_factor < 1.0:
            raise ValueError("the prefix policy's load factor must be >= 1")
        self.load_factor = load_factor
        self._fallback = LeastLoad()

    def bound(self, context: RoutingContext) -> int:
        """Most requests one worker may hold, counting the one being placed."""
        total = sum(load(w) for w in context.candidates) + 1
        return max(1, math.ceil(self.load_factor * total / len(context.candidates)))

    def select(self, context: RoutingContext) -> WorkerState:
        if context.key is None:
            return self._fallback.select(context)
        bound = self.bound(context)
        ranked = sorted(
            context.candidates, key=lambda w: score(context.key or "", w.key), reverse=True
        )
        for worker in ranked:
            if load(worker) + 1 <= bound:
                return worker
        return ranked[0]  # unreachable: some worker is always at or below the mean
