"""One request's accounting: its Prometheus metrics and its trace span, by its final status."""

from __future__ import annotations

import time
from collections.abc import Container

from gateway import metrics
from gateway.tracing import RequestSpan
from shared import protocol


class Accounting:
    """Counts one request once, however it ends (:meth:`finish`), and ends its span."""

    __slots__ = ("done", "known_models", "model", "route", "span", "started")

    def __init__(
        self,
        span: RequestSpan,
        model: str,
        route: str,
        known_models: Container[str],
        started: float | None = None,
    ) -> None:
        self.span = span
        # The requested model: a metrics label only if a worker ever served it
        # (``known_models``, the pool's live set), since clients choose names.
        self.model = model
        self.route = route
        self.known_models = known_models
        self.started = time.monotonic() if started is None else started
        self.done = False

    def first_chunk(self, now: float) -> None:
        """A stream's first output goes out (time to first token)."""
        metrics.child(metrics.TTFT, self.model, self.route).observe(now - self.started)
        self.span.event("first_token")

    def finish(self, status: int, usage: protocol.Usage | None = None) -> None:
        """Count the request once, by its final status."""
        if self.done:
            return
        self.done = True
        self.span.end(status)
        route = self.route
        model = self.model
        if model not in self.known_models:
            model = metrics.UNKNOWN_MODEL
        child = metrics.child
        child(metrics.REQUESTS, model, route, str(status)).inc()
        child(metrics.E2E_LATENCY, model, route).observe(time.monotonic() - self.started)
        if usage is not None:
            child(metrics.PROMPT_TOKENS, model).inc(usage.prompt_tokens)
            child(metrics.GENERATION_TOKENS, model).inc(usage.completion_tokens)
