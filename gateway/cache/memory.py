"""The in-process cache backend: an LRU bounded by bytes, entries with a TTL.

One per gateway process (``--cache memory``): processes and replicas do
not share it; Redis is for that (``gateway.cache.redis_store``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from gateway import metrics


class MemoryStore:
    """Values by key, least recently used evicted first once over ``max_bytes``."""

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._clock = clock
        # key -> (expires at, value); most recently used last.
        self._entries: collections.OrderedDict[str, tuple[float, bytes]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> bytes | None:
        found = self._entries.get(key)
        if found is None:
            return None
        expires, value = found
        if expires <= self._clock():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return value

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        if len(value) > self.max_bytes:
            return  # would evict everything and still not fit
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (self._clock() + ttl, value)
        self._grow(len(value))
        while self.bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)

    async def close(self) -> None:
        self._grow(-self.bytes)
        self._entries.clear()

    def _drop(self, key: str) -> None:
        _, value = self._entries.pop(key)
        self._grow(-len(value))

    def _grow(self, size: int) -> None:
        self.bytes += size
        metrics.CACHE_BYTES.inc(size)
