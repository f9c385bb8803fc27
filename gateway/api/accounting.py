"""One request's accounting: its Prometheus metrics, its trace span and its key's usage,
by its final status."""

from __future__ import annotations

import time
from collections.abc import Container

from gateway import metrics
from gateway.state.ledger import Ledger
from gateway.tracing import RequestSpan
from shared import protocol
from shared.api_keys import ANONYMOUS


class Accounting:
    """Counts one request once, however it ends (:meth:`finish`), and ends its span."""

    __slots__ = ("done", "key", "known_models", "ledger", "model", "route", "span", "started")

    def __init__(
        self,
        span: RequestSpan,
        model: str,
        route: str,
        known_models: Container[str],
        started: float | None = None,
        key: str = ANONYMOUS,
        ledger: Ledger | None = None,
    ) -> None:
        self.span = span
        # The requested model: a metrics label only if a worker ever served it
        # (``known_models``, the pool's live set), since clients choose names.
        self.model = model
        self.route = route
        self.known_models = known_models
        self.started = time.monotonic() if started is None else started
        # The API key's name (a label: names come from the keys file only),
        # and the usage ledger its usage goes to (``gateway.state.ledger``).
        self.key = key
        self.ledger = ledger
        self.done = False

    def first_chunk(self, now: float) -> None:
        """A stream's first output goes out (time to first token)."""
        metrics.child(metrics.TTFT, self.model, self.route).observe(now - self.started)
        self.span.event("first_token")

    def finish(
        self, status: int, usage: protocol.Usage | None = None, cached: bool = False
    ) -> None:
        """Count the request once, by its final status, with the usage its
        client was given (``cached``: a response cache hit, no engine work)."""
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
        child(metrics.KEY_REQUESTS, self.key, str(status)).inc()
        if usage is None:
            return
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        if not cached:  # the engine's work
            child(metrics.PROMPT_TOKENS, model).inc(prompt)
            child(metrics.GENERATION_TOKENS, model).inc(completion)
        # A request that reported no tokens (vLLM's /tokenize, /version, /ping) is no usage.
        if not prompt and not completion:
            return
        child(metrics.KEY_TOKENS, self.key, "prompt").inc(prompt)
        child(metrics.KEY_TOKENS, self.key, "completion").inc(completion)
        if cached:
            child(metrics.KEY_TOKENS, self.key, "cached").inc(prompt + completion)
        if self.ledger is not None:
            self.ledger.record(
                self.key, self.model, prompt, completion, prompt + completion if cached else 0
            )
