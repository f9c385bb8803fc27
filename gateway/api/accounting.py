"""One request's settlement: its Prometheus metrics, its trace span, its key's usage and
its key's token limits, once, by its final status and what the engine computed.

Every path a request can take (whole, streamed, a cache hit, a client gone, a
stream cut, a batch line, a request forwarded to vLLM's server) ends in
:meth:`Accounting.finish`, with the engine's own counts: the usage the
worker reported, or for a request that ended before it, the prompt and the
tokens delivered so far (``gateway.dispatch.handle.RequestHandle.computed``).
"""

from __future__ import annotations

import time
from collections.abc import Container

from gateway import metrics
from gateway.context import RequestContext
from gateway.state.ledger import Ledger
from gateway.tenants import limits
from gateway.tracing import RequestSpan
from shared import protocol


class Accounting:
    """Counts one request once, however it ends (:meth:`finish`), and ends its span."""

    __slots__ = ("context", "done", "known_models", "ledger", "model", "route", "span", "started")

    def __init__(
        self,
        span: RequestSpan,
        model: str,
        route: str,
        known_models: Container[str],
        context: RequestContext,
        ledger: Ledger | None = None,
    ) -> None:
        self.span = span
        # The requested model: a metrics label only if a worker ever served it
        # (``known_models``, the pool's live set), since clients choose names.
        self.model = model
        self.route = route
        self.known_models = known_models
        # Whose request it is (its key: a label by name, usage by id) and its
        # hold on the key's limits; the usage ledger (``gateway.state.ledger``).
        self.context = context
        self.ledger = ledger
        self.started = time.monotonic()
        self.done = False

    def first_chunk(self, now: float) -> None:
        """A stream's first output goes out (time to first token)."""
        metrics.child(metrics.TTFT, self.model, self.route).observe(now - self.started)
        self.span.event("first_token")

    def finish(
        self, status: int, usage: protocol.Usage | None = None, cached: bool = False
    ) -> None:
        """Settle the request once, by its final status, with what the engine
        computed for it (``cached``: a response cache hit, no engine work, so
        no tokens against the key's limits; None: nothing computed)."""
        if self.done:
            return
        self.done = True
        context = self.context
        if cached or usage is not None:
            limits.settle(context, None if cached else usage)
        self.span.end(status)
        route = self.route
        model = self.model
        if model not in self.known_models:
            model = metrics.UNKNOWN_MODEL
        elapsed = time.monotonic() - self.started
        metrics.child(metrics.E2E_LATENCY, model, route).observe(elapsed)
        key = context.key_name
        metrics.finished(model, route, str(status), key, usage, cached)
        if usage is None:
            return
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        # A request that reported no tokens (vLLM's /tokenize, /version, /ping) is no usage.
        if not prompt and not completion:
            return
        if self.ledger is not None:
            self.ledger.record(
                context.key_id,
                self.model,
                prompt,
                completion,
                prompt + completion if cached else 0,
                key,
            )
