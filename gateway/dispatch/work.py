"""One request's work for the pool: :class:`WorkOrder`, what the API hands dispatch.

It says what to run (the request's kind and parameters, under its id), where
it may run (its target: the pools, in tier order), until when, how it is
routed (the prefix policy's key), and on whose behalf (its API key's id, for
fair sharing, and whether it goes after interactive work). Admission and the
pool read it whole (``gateway.dispatch.pool.Pool.submit``); what changes between a
request's attempts (the workers a retry must avoid) goes beside it.

It and the other values made on every request (``Answerer``, ``Retries``,
``RoutingContext``) are frozen msgspec Structs, not frozen dataclasses: made
an order of magnitude faster (frozen dataclasses set each field through
``object.__setattr__``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.dispatch.models import Target, Tier
from shared import protocol


class WorkOrder(msgspec.Struct, frozen=True):
    request_id: str
    kind: protocol.RequestKind
    # The pools that may run it, in tier order (a bare model name: its workers).
    target: Target | str
    # The body the worker gets (OpenAI's and vLLM's field names).
    params: dict[str, Any]
    # Unix time after which it is given up (0: none).
    deadline: float = 0.0
    # The routing key (the prefix policy), or None.
    key: str | None = None
    # The request's trace context (W3C headers), for the worker.
    trace: dict[str, str] | None = None
    # Its priority band (a place in ``protocol.BANDS``): a higher band goes
    # first, here and in the engine; ``batch`` takes only spare slots.
    band: int = protocol.INTERACTIVE
    # The API key's id: admission shares slots between keys and charges this one.
    tenant: str | None = None
    # Whether ``key`` is the client's hint (X-Session-Id, prompt_cache_key):
    # every policy honours it.
    hinted: bool = False
    # A stream moved mid-answer: the token ids generated so far, which the
    # worker continues from (``protocol.Generate.continuation``).
    continuation: protocol.Continuation | None = None
    # A stream that may go on on another worker: a draining worker's hands
    # it over (``Pool.worker_draining``) rather than keep its drain waiting.
    movable: bool = False

    @property
    def low_priority(self) -> bool:
        """The batch band: only slots no other request waits for."""
        return self.band == protocol.BATCH

    @property
    def pools(self) -> Target:
        """Its target, a bare model name made a target of that name's workers."""
        target = self.target
        return target if isinstance(target, Target) else Target(target, (Tier("", target),))
