"""The two kinds of stream the runner stores: the Responses API's events, and
chat or completion chunks (a stream a client made resumable).

Each says what of an event a run again must repeat (``said``), which fields
every event keeps from the first run (``fix``), whether an event ends the
stream or is an error, what the failure event is, and how an event is framed
for a client (Responses: ``event:`` and ``data:``; chunks: ``id:`` with the
stream's id and the event's number, for ``Last-Event-ID``, then ``data:``,
and ``[DONE]`` after the last).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.state.background import RESPONSES_PATH

# A Responses stream's last event, and the status it gives the response.
TERMINAL = {
    "response.completed": "completed",
    "response.incomplete": "incomplete",
    "response.failed": "failed",
}

DONE = b"data: [DONE]\n\n"


class ResponsesKind:
    """The Responses API's events (``gateway.background`` responses)."""

    @staticmethod
    def said(event: dict[str, Any]) -> object:
        return event.get("type"), event.get("delta")

    @staticmethod
    def fix(event: dict[str, Any], fixed: dict[str, Any]) -> None:
        response = event.get("response")
        if isinstance(response, dict):
            response.update(fixed)

    @staticmethod
    def number(event: dict[str, Any], seq: int) -> None:
        event["sequence_number"] = seq

    @staticmethod
    def ends(event: dict[str, Any]) -> str:
        return TERMINAL.get(str(event.get("type")), "")

    @staticmethod
    def error(event: dict[str, Any]) -> str | None:
        """An error event's message (the gateway's own, for a cut stream)."""
        kind = event.get("type")
        if isinstance(kind, str) and kind.startswith("response."):
            return None
        error = event.get("error")
        return str(error.get("message", "")) if isinstance(error, dict) else "an error"

    @staticmethod
    def failure(response: dict[str, Any], error: dict[str, Any], seq: int) -> dict[str, Any]:
        failed = {**response, "status": "failed", "error": error}
        return {"type": "response.failed", "response": failed, "sequence_number": seq}

    @staticmethod
    def frame(stream_id: str, seq: int, data: bytes) -> bytes:
        kind = str(json.loads(data).get("type", ""))
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    @staticmethod
    def closing(status: str) -> bytes:
        return b""


class ChunksKind:
    """Chat or completion chunks, ending with ``[DONE]``."""

    @staticmethod
    def said(event: dict[str, Any]) -> object:
        said = []
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") if "delta" in choice else choice.get("text")
            said.append((choice.get("index"), text, delta.get("reasoning_content")))
        return said

    @staticmethod
    def fix(event: dict[str, Any], fixed: dict[str, Any]) -> None:
        event.update(fixed)

    @staticmethod
    def number(event: dict[str, Any], seq: int) -> None:
        return None  # a chunk's number is in its SSE id

    @staticmethod
    def ends(event: dict[str, Any]) -> str:
        return ""  # [DONE] ends it

    @staticmethod
    def error(event: dict[str, Any]) -> str | None:
        error = event.get("error")
        if error is None:
            return None
        return str(error.get("message", "")) if isinstance(error, dict) else "an error"

    @staticmethod
    def failure(response: dict[str, Any], error: dict[str, Any], seq: int) -> dict[str, Any]:
        return {"error": {**error, "type": "server_error", "param": None}}

    @staticmethod
    def frame(stream_id: str, seq: int, data: bytes) -> bytes:
        return f"id: {stream_id}:{seq}\ndata: ".encode() + data + b"\n\n"

    @staticmethod
    def closing(status: str) -> bytes:
        return DONE if status == "completed" else b""


Kind = ResponsesKind | ChunksKind


def kind_of(path: str) -> Kind:
    return ResponsesKind() if path == RESPONSES_PATH else ChunksKind()
