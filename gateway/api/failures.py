"""How an attempt on a worker failed, and whether another attempt may succeed.

A :data:`Failure` is the worker lost (``WorkerLost``) or its refusal
(``protocol.Failed``). :func:`retryable` says whether another worker (or
the same one) may take the request; :func:`reason_of` names why, as the
retries and migrations metrics label it. ``gateway.api.attempts`` retries
by them, ``gateway.api.migration`` moves by them.
"""

from __future__ import annotations

from gateway.dispatch.handle import WorkerLost
from shared import protocol

Failure = WorkerLost | protocol.Failed


def retryable(failure: Failure) -> bool:
    """Whether another attempt may succeed: the worker was lost, or refused with 503."""
    return isinstance(failure, WorkerLost) or failure.status == 503


def reason_of(failure: Failure) -> str:
    """The retries metric's label: what the worker said of its 503 (known
    causes only: a label value must not come from the wire unchecked)."""
    if isinstance(failure, WorkerLost):
        return "worker_lost"
    if failure.cause in (protocol.WORKER_DRAINING, protocol.GATEWAY_SILENT):
        return failure.cause
    return "worker_refused"
