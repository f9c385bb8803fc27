"""A key's rate windows, and the per-process store that keeps them in memory.

Requests and tokens per minute are each a GCRA bucket (:func:`gcra`): a key may
spend its whole minute at once, never gets more than its limit in any 60 s,
and is told exactly when the next unit frees (the ``Retry-After``).
Concurrency is a count of the key's requests under way. :class:`MemoryLimits`
is the store of one process (the default, and the fallback while Redis is
down); ``gateway.tenants.redis_limits`` runs the same arithmetic for every
process and replica at once. When to take, settle and give back is
``gateway.tenants.limits``'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.api_keys import KeyEntry

# Seconds of a rate window: the "per minute" of the limits.
WINDOW = 60.0

# Why a request was refused (Decision.refused_by).
REQUESTS = "requests"
TOKENS = "tokens"
CONCURRENT = "concurrent"
TOO_LARGE = "too_large"  # costs more tokens than the key's whole minute


@dataclass(frozen=True, slots=True)
class Decision:
    """A store's answer to "may this request start?", and the key's state after it."""

    allowed: bool
    refused_by: str = ""
    # Seconds until the request would fit (None: never, it is too large; a
    # concurrency refusal cannot know, and says 1).
    retry_after: float | None = 0.0
    remaining_requests: int = 0
    # Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*).
    reset_requests: float = 0.0
    remaining_tokens: int = 0
    reset_tokens: float = 0.0
    in_use: int = 0


@dataclass(frozen=True, slots=True)
class Window:
    """One GCRA step: whether ``cost`` fits, and the bucket's state either way."""

    fits: bool
    tat: float  # the new TAT if it fits
    wait: float  # seconds until it would fit (<= 0: fits now)
    remaining: int
    reset: float


# GCRA (generic cell rate algorithm): a token bucket written as one timestamp.
# A key with a limit of L a minute earns one unit every 60 / L seconds and may
# hold up to L of them. The bucket's state is its theoretical arrival time
# (TAT): the moment it is full again. A request of cost c fits when
# max(TAT, now) + c * 60 / L is at most a minute ahead; it then moves the TAT
# there. Not a fixed window keyed by the minute: that lets a client spend twice
# its limit across a minute's boundary and then makes it wait up to a minute.
# Not a sliding log: that keeps one entry per request or token, where GCRA keeps
# one number per key, and settling a token reservation is moving it.
def gcra(tat: float, now: float, cost: int, limit: int) -> Window:
    """The step of a ``limit``-a-minute bucket at ``tat`` for ``cost`` units at ``now``.

    ``remaining`` and ``reset`` describe the bucket after the request when it
    fits, and as it is when it does not. The Lua of ``redis_limits`` is this,
    line for line.
    """
    per_unit = WINDOW / limit
    start = max(tat, now)
    new_tat = start + cost * per_unit
    wait = new_tat - now - WINDOW
    fits = wait <= 0
    after = new_tat if fits else start
    remaining = math.floor((WINDOW - (after - now)) / per_unit + 1e-9)
    return Window(fits, new_tat, wait, max(0, remaining), after - now)


def refused_by(requests: Window | None, tokens: Window | None, cost: int, entry: KeyEntry) -> str:
    """Which limit refuses, in the order a client can act on: too large, then the windows."""
    if entry.tokens_per_minute and cost > entry.tokens_per_minute:
        return TOO_LARGE
    if requests is not None and not requests.fits:
        return REQUESTS
    if tokens is not None and not tokens.fits:
        return TOKENS
    return ""


class MemoryLimits:
    """Every key's windows and running count in this process (``--limits`` empty)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._requests: dict[str, float] = {}
        self._tokens: dict[str, float] = {}
        self._running: dict[str, int] = {}

    def admit(self, entry: KeyEntry, cost: int) -> Decision:
        now = self.clock()
        name = entry.id  # the key's stable id: a name added again is a new key
        requests = tokens = None
        if entry.requests_per_minute:
            requests = gcra(self._requests.get(name, now), now, 1, entry.requests_per_minute)
        if entry.tokens_per_minute:
            tokens = gcra(self._tokens.get(name, now), now, cost, entry.tokens_per_minute)
        in_use = self._running.get(name, 0)
        refused = refused_by(requests, tokens, cost, entry)
        if not refused and entry.max_concurrent and in_use >= entry.max_concurrent:
            refused = CONCURRENT
        if not refused:
            if requests is not None:
                self._requests[name] = requests.tat
            if tokens is not None:
                self._tokens[name] = tokens.tat
            if entry.max_concurrent:
                in_use += 1
                self._running[name] = in_use
        return decide(refused, requests, tokens, in_use)

    def settle(self, entry: KeyEntry, delta: int) -> None:
        """Move the key's token window by ``delta`` tokens (negative: a refund)."""
        if not entry.tokens_per_minute or not delta:
            return
        now = self.clock()
        tat = max(self._tokens.get(entry.id, now), now)
        self._tokens[entry.id] = tat + delta * WINDOW / entry.tokens_per_minute

    def refund_request(self, entry: KeyEntry) -> None:
        """Give back one request of the key's requests window."""
        if not entry.requests_per_minute:
            return
        now = self.clock()
        tat = max(self._requests.get(entry.id, now), now)
        self._requests[entry.id] = tat - WINDOW / entry.requests_per_minute

    def release(self, entry: KeyEntry) -> None:
        running = self._running.get(entry.id, 0)
        if running <= 1:
            self._running.pop(entry.id, None)
        else:
            self._running[entry.id] = running - 1

    def running(self, key_id: str) -> int:
        return self._running.get(key_id, 0)


def decide(refused: str, requests: Window | None, tokens: Window | None, in_use: int) -> Decision:
    """The Decision for ``refused`` ("" = allowed) and the windows' states."""
    retry_after: float | None = 0.0
    if refused == TOO_LARGE:
        retry_after = None
    elif refused == CONCURRENT:
        retry_after = 1.0
    elif refused:
        retry_after = max(w.wait for w in (requests, tokens) if w is not None and not w.fits)
    return Decision(
        allowed=not refused,
        refused_by=refused,
        retry_after=retry_after,
        remaining_requests=requests.remaining if requests else 0,
        reset_requests=requests.reset if requests else 0.0,
        remaining_tokens=tokens.remaining if tokens else 0,
        reset_tokens=tokens.reset if tokens else 0.0,
        in_use=in_use,
    )
