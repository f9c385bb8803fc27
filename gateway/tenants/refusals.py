"""How a key's limits answer: OpenAI's ``x-ratelimit-*`` headers and the
wording of its 429s (``gateway.tenants.limits``).
"""

from __future__ import annotations

import math

from prometheus_client import Counter

from gateway import errors
from gateway.tenants.windows import CONCURRENT, TOO_LARGE, Decision
from shared.api_keys import KeyEntry

REFUSED = Counter(
    "llmgate_limits_refused",
    "Requests refused with 429 by their API key's limits, by key name and limit "
    "(requests, tokens, concurrent, too_large, budget).",
    ["key", "limit"],
)

_LABELS = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI's reset headers write it: ``20ms``, ``1s``, ``1.5s``, ``6m0s``."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    text = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


def rate_headers(entry: KeyEntry, decision: Decision) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for the key's windows (none for a limit it has not)."""
    headers = {}
    if entry.requests_per_minute:
        headers["x-ratelimit-limit-requests"] = str(entry.requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(decision.remaining_requests)
        headers["x-ratelimit-reset-requests"] = duration(decision.reset_requests)
    if entry.tokens_per_minute:
        headers["x-ratelimit-limit-tokens"] = str(entry.tokens_per_minute)
        headers["x-ratelimit-remaining-tokens"] = str(decision.remaining_tokens)
        headers["x-ratelimit-reset-tokens"] = duration(decision.reset_tokens)
    return headers


def refusal(entry: KeyEntry, decision: Decision, cost: int) -> errors.RateLimited:
    """The 429 for a refused ``decision``, worded as OpenAI words its own."""
    name = entry.name
    if decision.refused_by == TOO_LARGE:
        return errors.RateLimited(
            f"Request too large for the API key {name!r} on tokens per min (TPM): "
            f"Limit {entry.tokens_per_minute}, Requested {cost}. Reduce the prompt "
            "or max_tokens.",
            None,
            "tokens",
        )
    wait = math.ceil(decision.retry_after or 1)
    if decision.refused_by == CONCURRENT:
        return errors.RateLimited(
            f"Concurrency limit reached for the API key {name!r}: Limit "
            f"{entry.max_concurrent} requests at once. Please try again when one ends.",
            wait,
        )
    if decision.refused_by == "requests":
        limit, remaining, requested = entry.requests_per_minute, decision.remaining_requests, 1
    else:
        limit, remaining, requested = entry.tokens_per_minute, decision.remaining_tokens, cost
    return errors.RateLimited(
        f"Rate limit reached for the API key {name!r} on {_LABELS[decision.refused_by]}: "
        f"Limit {limit}, Used {limit - remaining}, Requested {requested}. "
        f"Please try again in {duration(decision.retry_after or 0)}.",
        wait,
        "tokens" if decision.refused_by == "tokens" else "requests",
    )
