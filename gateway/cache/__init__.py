"""The response cache (``--cache``): never compute the same answer twice.

``keys`` says what a response is cached under and which requests may use
the cache; ``cache`` holds the entries and survives a failing backend;
``memory`` and ``redis_store`` are the two backends. ``gateway.api.call``
looks a request up before admission and stores a response that finished
normally.
"""

from __future__ import annotations

from typing import cast

from gateway.cache.cache import Entry, ResponseCache, Store
from gateway.cache.keys import SCOPES, Controls, Scope, controls, in_scope, key_for
from gateway.cache.memory import MemoryStore

__all__ = [
    "SCOPES",
    "Controls",
    "Entry",
    "ResponseCache",
    "check_settings",
    "controls",
    "in_scope",
    "key_for",
    "open_cache",
]


def check_settings(url: str, scope: str) -> str | None:
    """What is wrong with ``--cache``/``--cache-scope``, or None."""
    if url and url != "memory" and not url.startswith(("redis://", "rediss://", "unix://")):
        return f"--cache must be empty, `memory` or a redis:// URL, not {url!r}"
    if scope not in SCOPES:
        return f"--cache-scope must be one of {', '.join(SCOPES)}, not {scope!r}"
    return None


def open_cache(url: str, ttl: float, max_bytes: int, scope: str) -> ResponseCache | None:
    """The cache ``--cache`` asks for; None when it is off."""
    if not url:
        return None
    store: Store
    if url == "memory":
        store = MemoryStore(max_bytes)
        name = "memory"
    else:
        from gateway.cache.redis_store import RedisStore

        store = RedisStore(url)
        name = url
    return ResponseCache(store, ttl, cast(Scope, scope), name)
