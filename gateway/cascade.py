"""Cascade: keep the cheap model's answer, or ask the expensive one.

For a non-streaming request that ``auto`` sent down its default route
(``gateway.models``), the cheap model answers first, with token logprobs
asked for whether or not the client asked (the response shows them only if
it did). Its answer is kept when the mean logprob of its tokens, over all
choices, is at least the config's ``min_mean_logprob`` and, if the request
asked for a JSON ``response_format``, every choice parses as JSON.
Otherwise the request is run again on the escalation target and the client
gets that answer alone.
"""

from __future__ import annotations

import json
from typing import Any

from gateway import sse
from shared import protocol


def with_logprobs(kind: protocol.RequestKind, raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` asking for each generated token's logprob (a copy, if it did not)."""
    if kind == "chat":
        return raw if raw.get("logprobs") else {**raw, "logprobs": True}
    # Completions: 0 = the sampled token's logprob, no alternatives.
    return raw if raw.get("logprobs") is not None else {**raw, "logprobs": 0}


def mean_logprob(builder: sse.ResponseBuilder) -> float | None:
    """Mean logprob of the generated tokens of every choice (None: no token)."""
    values = [t.logprob for c in builder.choices for t in c.logprobs if t.scored]
    return sum(values) / len(values) if values else None


def shortfall(builder: sse.ResponseBuilder, raw: dict[str, Any], min_mean: float) -> str | None:
    """Why the answer in ``builder`` is not good enough ("low_confidence",
    "invalid_json"), or None to keep it."""
    response_format = raw.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in (
        "json_object",
        "json_schema",
    ):
        for choice in builder.choices:
            try:
                json.loads("".join(choice.text))
            except ValueError:
                return "invalid_json"
    mean = mean_logprob(builder)
    if mean is not None and mean < min_mean:
        return "low_confidence"
    return None
