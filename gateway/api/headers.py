"""What a response says about who answered it: llmgate's ``x-llmgate-*`` headers.

The worker, the served model and the pool that answered (the body's
``model`` stays the requested name, as OpenAI's does), the ``auto`` rule
that chose them, the cascade's outcome and what the response cache did.
"""

from __future__ import annotations

from gateway.dispatch.handle import Answerer

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

WORKER_HEADER = "x-llmgate-worker"
MODEL_HEADER = "x-llmgate-model"
POOL_HEADER = "x-llmgate-pool"
ROUTE_HEADER = "x-llmgate-route"
CASCADE_HEADER = "x-llmgate-cascade"
# What the response cache did: hit, miss or bypass (absent with no --cache).
CACHE_HEADER = "x-llmgate-cache"


def answer_headers(
    answered_by: Answerer, rule: str = "", cascade: str = "", cache: str = ""
) -> dict[str, str]:
    """The headers of an answer from ``answered_by``: ``rule``, the auto rule
    that chose its model; ``cascade``, accepted or escalated; ``cache``, the
    response cache's hit, miss or bypass ("" for none of these)."""
    headers = {WORKER_HEADER: answered_by.address, MODEL_HEADER: answered_by.model}
    if answered_by.pool:
        headers[POOL_HEADER] = answered_by.pool
    if rule:
        headers[ROUTE_HEADER] = rule
    if cascade:
        headers[CASCADE_HEADER] = cascade
    if cache:
        headers[CACHE_HEADER] = cache
    return headers
