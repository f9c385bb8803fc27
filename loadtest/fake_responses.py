"""The FAKE engine's Responses API stream (``POST /v1/responses``, ``stream: true``).

A double for the fault tests of background responses: the events vLLM's
server sends for a one-message answer (created, in progress, the item and
its part added, a text delta per token, their ends, completed), framed as it
frames them, with the engine's ``" fake"`` tokens. Each run names its output
item afresh, as vLLM does. The gate holds it after ``Gate.after`` tokens like
any request of the double. Nothing else of vLLM's routes is here.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any


def frame(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


async def events(
    body: dict[str, Any],
    text: str,
    tokens: int,
    before_token: Callable[[int], Awaitable[None]],
) -> AsyncIterator[bytes]:
    """The stream's frames; ``before_token(step)`` runs before each token."""
    item_id = f"msg_{secrets.token_hex(8)}"
    response = {
        "id": body.get("request_id") or f"resp_{secrets.token_hex(16)}",
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model", ""),
        "status": "in_progress",
        "background": bool(body.get("background")),
        "output": [],
        "usage": None,
    }
    seq = iter(range(1 << 30))
    item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress"}
    yield frame({"type": "response.created", "response": response, "sequence_number": next(seq)})
    yield frame(
        {"type": "response.in_progress", "response": response, "sequence_number": next(seq)}
    )
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield frame(
        {
            "type": "response.output_item.added",
            "item": {**item, "content": []},
            "output_index": 0,
            "sequence_number": next(seq),
        }
    )
    yield frame({"type": "response.content_part.added", **where, "sequence_number": next(seq)})
    for step in range(tokens):
        await before_token(step)
        yield frame(
            {
                "type": "response.output_text.delta",
                **where,
                "delta": text,
                "logprobs": [],
                "sequence_number": next(seq),
            }
        )
    whole = text * tokens
    part = {"type": "output_text", "text": whole, "annotations": []}
    yield frame(
        {"type": "response.output_text.done", **where, "text": whole, "sequence_number": next(seq)}
    )
    yield frame(
        {"type": "response.content_part.done", **where, "part": part, "sequence_number": next(seq)}
    )
    done = {**item, "status": "completed", "content": [part]}
    yield frame(
        {
            "type": "response.output_item.done",
            "item": done,
            "output_index": 0,
            "sequence_number": next(seq),
        }
    )
    usage = {"input_tokens": 1, "output_tokens": tokens, "total_tokens": tokens + 1}
    ended = {**response, "status": "completed", "output": [done], "usage": usage}
    yield frame({"type": "response.completed", "response": ended, "sequence_number": next(seq)})
