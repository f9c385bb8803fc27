"""The response cache's settings, checked where they are read (the gateway,
``llmgate serve``, the pools file's ``cache:`` section), without importing
the cache itself."""

from __future__ import annotations

from shared.redact import redact_url

# Which requests the cache may answer: those whose answer is deterministic
# (seeded or greedy), greedy ones only, or all.
SCOPES = ("deterministic", "greedy", "all")


def check_cache_settings(url: str, scope: str) -> str | None:
    """What is wrong with ``--cache``/``--cache-scope``, or None."""
    if url and url != "memory" and not url.startswith(("redis://", "rediss://", "unix://")):
        return f"--cache must be empty, `memory` or a redis:// URL, not {redact_url(url)!r}"
    if scope not in SCOPES:
        return f"--cache-scope must be one of {', '.join(SCOPES)}, not {scope!r}"
    return None
