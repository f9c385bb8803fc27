"""The response cache: what an entry holds, and a backend that may fail without harm.

An entry is the worker's output as it came (the deltas, in order, and the
usage), not a rendered body: a hit goes through the same response builders
as a fresh answer (``gateway.dialects.sse``), so it comes back whole or as a stream
of the same chunk shapes, whichever the request asks for, with its own id
and creation time.

A backend that fails (Redis down, a timeout) never fails a request: the
request is served uncached, a warning is logged once per outage, the
failure is counted (``llmgate_cache_errors_total``), and the cache is left
alone for ``RETRY_AFTER`` seconds before it is tried again.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import msgspec

from gateway import metrics
from gateway.cache.cache_key import Scope
from shared import protocol

log = logging.getLogger(__name__)

# Seconds a failed backend is left alone before the next try.
RETRY_AFTER = 5.0


class Entry(msgspec.Struct, array_like=True, gc=False):
    """One finished response, as the worker sent it."""

    deltas: list[protocol.Delta]
    usage: protocol.Usage
    # The engine that computed it: a hit is served only while a worker of
    # the same fingerprint serves the model (a changed engine recomputes).
    served_model: str
    system_fingerprint: str | None
    # The gateway's x-llmgate-* headers of the answer (model, pool, route).
    headers: dict[str, str]


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Entry).decode


class Store(Protocol):
    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes, ttl: float) -> None: ...

    async def close(self) -> None: ...


class ResponseCache:
    def __init__(self, store: Store, ttl: float, scope: Scope, name: str) -> None:
        self.store = store
        self.ttl = ttl
        self.scope: Scope = scope
        self.name = name  # for logs: "memory" or the Redis URL (its password hidden)
        self._down_until = 0.0

    async def get(self, key: str) -> Entry | None:
        value = await self.get_bytes(key)
        if value is None:
            return None
        try:
            return _decode(value)
        except msgspec.DecodeError:
            log.warning("dropping an unreadable cache entry %s", key[:16])
            return None

    async def put(self, key: str, entry: Entry) -> None:
        await self.put_bytes(key, _encode(entry))

    async def get_bytes(self, key: str) -> bytes | None:
        """The value under ``key``; None when absent or the backend is failing."""
        if self._down():
            return None
        try:
            value = await self.store.get(key)
        except Exception as exc:  # the backend's errors are many; all mean "not now"
            self._failed("get", exc)
            return None
        self._ok()
        return value

    async def put_bytes(self, key: str, value: bytes) -> None:
        """Keep ``value`` for the TTL; a failing backend drops it (and is counted)."""
        if self._down():
            return
        try:
            await self.store.put(key, value, self.ttl)
        except Exception as exc:
            self._failed("put", exc)
            return
        self._ok()

    async def close(self) -> None:
        try:
            await self.store.close()
        except Exception as exc:
            log.warning("closing the cache (%s): %s", self.name, exc)

    def _down(self) -> bool:
        return bool(self._down_until) and time.monotonic() < self._down_until

    def _failed(self, operation: str, exc: Exception) -> None:
        metrics.CACHE_ERRORS.labels(operation).inc()
        if not self._down_until:
            log.warning(
                "response cache %s failed (%s: %s); serving uncached, retrying every %.0f s",
                self.name,
                type(exc).__name__,
                exc,
                RETRY_AFTER,
            )
        self._down_until = time.monotonic() + RETRY_AFTER

    def _ok(self) -> None:
        if self._down_until:  # the first success after an outage
            log.warning("response cache %s is back", self.name)
            self._down_until = 0.0
