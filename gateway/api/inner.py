"""A request the gateway sends to its own app: a batch line, a background response.

It runs the whole request path (admission, routing, retries, limits, usage)
as ``context`` says (its owner's key), like a client's request. Its body is
sent at once; then it is a client that stays until ``leave`` is set, when it
disconnects (the app aborts the request on its worker). ``send`` gets the
ASGI messages of the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message

from gateway.api.request_ids import HEADER as REQUEST_ID_HEADER
from gateway.context import SCOPE_KEY as CONTEXT
from gateway.context import RequestContext


async def own_request(
    app: ASGIApp,
    path: str,
    body: bytes,
    request_id: str,
    context: RequestContext,
    leave: asyncio.Event,
    send: Callable[[Message], Awaitable[None]],
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """POST ``body`` (JSON) to ``path`` on ``app`` under ``request_id``."""
    # Named here: the id middleware, which reads the header, is above ``app``.
    context.request_id = context.request_id or request_id
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (REQUEST_ID_HEADER, request_id.encode()),
            *headers,
        ],
        "client": None,
        "server": None,
        "state": {},
        CONTEXT: context,
    }
    sent_body = False

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        # Then as a client that stays until told to leave: the app watches
        # for this while the request waits or runs.
        await leave.wait()
        return {"type": "http.disconnect"}

    await app(scope, receive, send)
