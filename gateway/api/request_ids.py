"""Every HTTP request's id: the client's ``X-Request-Id``, or one made here.

The outermost ASGI layer, so it covers every route and every answer,
errors, 429s and API-key refusals included: the id goes back in the
response's ``X-Request-Id`` header, onto every log line written while the
request is handled (``shared.logs.request_id``), to the worker as the id of
the ``Generate`` message, and from there to vLLM as its request id. The
response bodies' ``id`` fields are built from it too (``cmpl-ID``,
``chatcmpl-ID``), as ``vllm serve`` builds them from the same header.
"""

from __future__ import annotations

import itertools
import os

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import errors
from gateway.routes import render
from shared import logs

HEADER = b"x-request-id"
MAX_LENGTH = 128

# This process's random part and a counter: unique across gateways and
# restarts, and cheaper than a uuid4 per request.
_PREFIX = os.urandom(6).hex() + "-"
_numbers = itertools.count(1)


def new_request_id() -> str:
    return f"{_PREFIX}{next(_numbers)}"


def request_id_of(scope: Scope) -> str:
    """The id :class:`RequestIds` gave this request (a new one if it did not run)."""
    state = scope.setdefault("state", {})
    rid: str | None = state.get("request_id")
    if rid is None:
        rid = state["request_id"] = new_request_id()
    return rid


def check(value: bytes) -> str:
    """A client's id as text; 400 unless it is 1 to 128 printable ASCII characters."""
    if 0 < len(value) <= MAX_LENGTH and value.isascii():
        text = value.decode("ascii")
        if text.isprintable() and " " not in text:
            return text
    raise errors.BadRequest(
        f"X-Request-Id must be 1 to {MAX_LENGTH} printable ASCII characters without spaces."
    )


class RequestIds:
    """Gives each HTTP request its id and returns it in the ``X-Request-Id`` header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for key, value in scope["headers"]:
            if key == HEADER:
                given = value
                break
        bad: errors.GatewayError | None = None
        if given is None:
            rid = new_request_id()
        else:
            try:
                rid = check(given)
            except errors.BadRequest as exc:
                rid, bad = new_request_id(), exc
        scope.setdefault("state", {})["request_id"] = rid
        header = (HEADER, rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        with logs.for_request(rid):
            if bad is not None:
                response = render(bad, scope["path"])  # in the route's dialect
                await response(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
