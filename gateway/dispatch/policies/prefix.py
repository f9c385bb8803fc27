"""Prefix affinity: a conversation stays on the worker that holds its history.

Requests with the same key (a session key, else the conversation's start:
``gateway.api.openai_routes``) go to the worker the key was placed on, so vLLM's
prefix cache there holds what came before. The key moves only when that worker
is gone or past :meth:`PrefixAffinity.bound`: ``load_factor`` times the mean
load (consistent hashing with bounded loads, Mirrokni et al. 2018) or ``slack``
requests over it, whichever allows more. A key is placed on the least loaded
worker, ties broken by rendezvous hashing (:func:`score`), so every gateway
replica places it alike. Placements are this process's alone, in a bounded LRU
map; a request with no key is ``least_load``'s.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import TYPE_CHECKING

from gateway.dispatch.policies import RoutingContext, load
from gateway.dispatch.policies.least_load import LeastLoad

if TYPE_CHECKING:
    from gateway.dispatch.workers import Worker

# Placements kept per process (an LRU map); a key forgotten is placed again
# like a new one. About 100 bytes each: a few MiB at most.
REMEMBERED_KEYS = 65_536


def score(key: str, worker_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PrefixAffinity:
    uses_key = True

    def __init__(
        self, load_factor: float = 1.25, slack: int = 4, remembered: int = REMEMBERED_KEYS
    ) -> None:
        if load_factor < 1.0:
            raise ValueError("the prefix policy's load factor must be >= 1")
        if slack < 0:
            raise ValueError("the prefix policy's load slack must be >= 0")
        self.load_factor = load_factor
        self.slack = slack
        self.remembered = remembered
        self._fallback = LeastLoad()
        # key -> Worker.key of the worker it was placed on, oldest first.
        self._placed: OrderedDict[str, str] = OrderedDict()

    def bound(self, context: RoutingContext) -> int:
        """Most requests one worker may hold, counting the one being placed."""
        # The slack is for small loads, where a ratio alone is a hair trigger:
        # with two workers and two requests on the home worker, 1.25 times the
        # mean (1.5) would move the third away, and the worker it moves to
        # recomputes the whole history, where joining the running batch at home
        # costs that batch a little time per step (docs/benchmarks.md, the
        # multiturn scenario). SGLang's gateway keeps cache affinity the same
        # way, until loads differ by an absolute and a relative threshold.
        total = sum(load(w) for w in context.candidates) + 1
        workers = len(context.candidates)
        over_mean = -(-total // workers) + self.slack  # ceil(mean) + slack, in integers
        return max(1, math.ceil(self.load_factor * total / workers), over_mean)

    def select(self, context: RoutingContext) -> Worker:
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
        # Least loaded first, so a few long conversations do not pile onto one
        # worker as pure hashing would; rendezvous hashing of (key, worker)
        # breaks ties, so an idle pool places a key alike in every replica.
        chosen = min(context.candidates, key=lambda w: (load(w), -score(key, w.key)))
        self._placed[key] = chosen.key
        self._placed.move_to_end(key)
        if len(self._placed) > self.remembered:
            self._placed.popitem(last=False)
        return chosen
