"""Cascade: keep the cheap model's answer, or ask the expensive one.

For a non-streaming request that ``auto`` sent down its default route
(``gateway.dispatch.models``), the cheap model answers first, with token logprobs
asked for whether or not the client asked (the response shows them only if
it did). Its answer is kept when the mean logprob of its tokens, over all
choices, is at least the config's ``min_mean_logprob`` and, if the request
asked for a JSON ``response_format``, every choice parses as JSON.
Otherwise the request is run again on the escalation target and the client
gets that answer alone.

:func:`run` is that loop, over the caller's ``attempts``: one run of the
request on a target, to its end, with retries of its own
(``gateway.api.attempts``), its output in the response builder.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol, TypeVar

from gateway import metrics
from gateway.dialects import sse
from gateway.dispatch.models import Target
from shared import protocol

log = logging.getLogger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


def applies(target: Target, kind: protocol.RequestKind) -> bool:
    """Whether a request for ``target`` is cascaded: the target escalates, and
    the answer is our own builder's (not vLLM's, whose logprobs it cannot judge)."""
    return target.escalate_to is not None and kind != "vllm"


class Runs(Protocol[T_co]):
    """How a cascade runs the request (``gateway.api.attempts.Attempts``)."""

    async def run(self, target: Target, body: dict[str, Any]) -> T_co:
        """Run the request to its end on ``target``, its output in the builder."""
        ...

    def forget_output(self) -> None:
        """Drop that output before the escalation runs."""
        ...


async def run(
    target: Target,
    kind: protocol.RequestKind,
    raw: dict[str, Any],
    builder: sse.ResponseBuilder,
    attempts: Runs[T],
    log_extra: dict[str, str] | None = None,
) -> tuple[T, str]:
    """The answer the client gets, and the cascade's outcome: "accepted" (the
    default model's answer was good enough) or "escalated"."""
    escalate_to = target.escalate_to
    assert escalate_to is not None
    answer = await attempts.run(target, with_logprobs(kind, raw))
    reason = shortfall(builder, raw, target.min_mean_logprob)
    if reason is None:
        metrics.CASCADE.labels("accepted").inc()
        return answer, "accepted"
    log.debug(
        "cascade: escalating from %s to %s (%s)",
        target.model,
        escalate_to.model,
        reason,
        extra=log_extra,
    )
    metrics.CASCADE.labels("escalated").inc()
    attempts.forget_output()
    escalated = Target(escalate_to.model, escalate_to.tiers, rule=target.rule)
    return await attempts.run(escalated, raw), "escalated"


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
