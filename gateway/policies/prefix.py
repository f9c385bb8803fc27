"""Prefix affinity: a conversation stays on the worker that holds its history.

Requests with the same key (a session key, else the conversation's start:
``gateway.api.openai``) go to the worker the key was placed on, so vLLM's
prefix cache there holds what came before, as long as that worker's load
stays within ``load_factor`` times the mean (consistent hashing with
bounded loads, Mirrokni et al. 2018); past it, or when that worker is gone,
the key is placed again.

A new key is placed on the least loaded worker, ties broken by rendezvous
hashing of (key, worker), so an idle pool places a key the same way in
every gateway replica, and a few long conversations do not pile onto one
worker as pure hashing would (measured on multi-turn chat with the
``multiturn`` bench scenario: docs/benchmarks.md). Placements are kept per
gateway process in a bounded LRU map (``REMEMBERED_KEYS``); a key forgotten
is placed again like a new one.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import TYPE_CHECKING

from gateway.policies import RoutingContext, load
from gateway.policies.least_load import LeastLoad

if TYPE_CHECKING:
    from gateway.workers import WorkerState

# About 100 bytes each: a few MiB at most.
REMEMBERED_KEYS = 65_536


def score(key: str, worker_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PrefixAffinity:
    uses_key = True

    def __init__(self, load_factor: float = 1.25, remembered: int = REMEMBERED_KEYS) -> None:
        if load_factor < 1.0:
            raise ValueError("the prefix policy's load factor must be >= 1")
        self.load_factor = load_factor
        self.remembered = remembered
        self._fallback = LeastLoad()
        # key -> WorkerState.key of the worker it was placed on, oldest first.
        self._placed: OrderedDict[str, str] = OrderedDict()

    def bound(self, context: RoutingContext) -> int:
        """Most requests one worker may hold, counting the one being placed."""
        total = sum(load(w) for w in context.candidates) + 1
        return max(1, math.ceil(self.load_factor * total / len(context.candidates)))

    def select(self, context: RoutingContext) -> WorkerState:
        key = context.key
        if key is None:
            return self._fallback.select(context)
        bound = self.bound(context)
        home = self._placed.get(key)
        if home is not None:
            for worker in context.candidates:
                if worker.key == home and load(worker) + 1 <= bound:
                    self._placed.move_to_end(key)
                    return worker
        # New, forgotten, or its worker is gone or past the bound: place it.
        chosen = min(context.candidates, key=lambda w: (load(w), -score(key, w.key)))
        self._placed[key] = chosen.key
        self._placed.move_to_end(key)
        if len(self._placed) > self.remembered:
            self._placed.popitem(last=False)
        return chosen
