"""The response cache (``--cache``): never compute the same answer twice.

``keys`` says what a response is cached under and which requests may use
the cache; ``cache`` holds the entries and survives a failing backend;
``memory`` and ``redis_store`` are the two backends. ``gateway.api.call``
looks a request up before admission and stores a response that finished
normally. The settings come from flags and ``LLMGATE_CACHE*`` variables, and
where those are left at their defaults from the pools file's ``cache:``
section (:func:`merge_config`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import msgspec

from gateway.cache.cache import Entry, ResponseCache, Store
from gateway.cache.cache_key import Controls, Scope, controls, in_scope, key_for
from gateway.cache.memory import MemoryStore
from shared.cache_settings import SCOPES
from shared.redact import redact_url

if TYPE_CHECKING:
    from shared.config import Config
    from shared.settings import CacheSettings

__all__ = [
    "SCOPES",
    "Controls",
    "Entry",
    "ResponseCache",
    "controls",
    "in_scope",
    "key_for",
    "merge_config",
    "open_cache",
]


def merge_config(settings: CacheSettings, config: Config | None) -> CacheSettings:
    """``settings`` with the pools file's ``cache:`` section filling in each cache
    setting that flags and environment left at its default: they win."""
    section = config.cache if config is not None else None
    if section is None:
        return settings
    defaults = {field.name: field.default for field in msgspec.structs.fields(settings)}
    from_file = {
        "cache": section.url or None,
        "cache_ttl": section.ttl,
        "cache_max_bytes": section.max_bytes,
        "cache_scope": section.scope,
    }
    changes = {
        name: value
        for name, value in from_file.items()
        if value is not None and getattr(settings, name) == defaults[name]
    }
    return msgspec.structs.replace(settings, **changes)


def open_cache(settings: CacheSettings) -> ResponseCache | None:
    """The cache ``--cache`` asks for; None when it is off."""
    url = settings.cache
    if not url:
        return None
    store: Store
    if url == "memory":
        store = MemoryStore(settings.cache_max_bytes)
        name = "memory"
    else:
        from gateway.cache.redis_store import RedisStore

        store = RedisStore(url)
        name = redact_url(url)
    return ResponseCache(store, settings.cache_ttl, cast(Scope, settings.cache_scope), name)
