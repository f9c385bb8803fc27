"""gateway/background/runner.py over a real SQLite store and a stand-in app.

The app here is a plain ASGI function that answers the runner's request with
the Responses events a test gives it: what a worker's run would stream. A
takeover whose run says something else than the events already sent must
end the response ``failed``, saying so, and add nothing to what was sent.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
from starlette.types import Receive, Scope, Send

from gateway.api.responses import Record
from gateway.background.runner import Runner
from gateway.state import State
from shared.settings import StoreSettings

RESPONSE = {"id": "resp_1", "object": "response", "status": "queued", "created_at": 1}


def events(deltas: list[str]) -> list[dict[str, Any]]:
    response = {**RESPONSE, "status": "in_progress", "created_at": 9}
    return [
        {"type": "response.created", "response": response},
        *({"type": "response.output_text.delta", "item_id": "msg_x", "delta": d} for d in deltas),
        {"type": "response.completed", "response": {**response, "status": "completed"}},
    ]


def streaming(answer: list[dict[str, Any]]) -> Any:
    """An ASGI app that streams ``answer`` as SSE."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # the body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for event in answer:
            data = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def ran_again_with(tmp_path: Path, answer: list[dict[str, Any]]) -> tuple[str, list[Any]]:
    """A response whose first run sent two events and died; another runner
    runs it again with ``answer``: its status and every event stored."""
    state = State(StoreSettings(state_dir=str(tmp_path)))
    await state.connect()
    store = state.background
    record = msgspec.json.encode(Record(RESPONSE, []))
    store.create("resp_1", None, b'{"input":"hi"}', record)
    store.claim("dead", 1, lease=60)
    first = [msgspec.json.encode(e) for e in events(["One"])[:2]]
    assert store.append("dead", "resp_1", 0, first)
    store.renew("dead", -1, ["resp_1"])  # its lease lapses
    runner = Runner(state, streaming(answer), lease_seconds=60, max_runs=0)
    runner.start()
    try:
        async with asyncio.timeout(60):  # a hang guard: the run ends at once
            while store.status("resp_1", None) not in ("completed", "failed"):
                # Woken by each write of the runner's (the wait's bound aside).
                await runner.notices.wait("resp_1", 1.0)
    finally:
        await runner.stop()
        await state.stop()
    state = State(StoreSettings(state_dir=str(tmp_path)))
    await state.connect()
    status, stored = state.background.events("resp_1", -1, None) or ("", [])
    await state.stop()
    return status, [json.loads(data) for _, data in stored]


async def test_a_run_again_that_repeats_the_events_sent_goes_on_after_them(
    tmp_path: Path,
) -> None:
    status, stored = await ran_again_with(tmp_path, events(["One", " two"]))
    assert status == "completed"
    assert [e.get("delta") for e in stored] == [None, "One", " two", None]
    assert [e["sequence_number"] for e in stored[2:]] == [2, 3]
    assert stored[-1]["response"]["created_at"] == 1  # the stored response's


async def test_a_run_again_that_says_something_else_fails_the_response(
    tmp_path: Path,
) -> None:
    status, stored = await ran_again_with(tmp_path, events(["Two", " three"]))
    assert status == "failed"
    assert [e.get("delta") for e in stored[:2]] == [None, "One"]  # nothing of the run
    assert [e["type"] for e in stored[2:]] == ["response.failed"]
    error = stored[-1]["response"]["error"]
    assert error["code"] == "server_error" and "another answer" in error["message"]
