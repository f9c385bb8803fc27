"""Every HTTP request's id: the client's ``X-Request-Id``, or one made here.

Every answer carries it back in its ``X-Request-Id`` header, errors, 429s and
API-key refusals included; the gateway's log lines about the request name it
(``extra={"request_id": ...}``, see ``shared.logs``); the worker gets it as the id
of the ``Generate`` message and gives it to vLLM as its request id. The
response bodies' ``id`` fields are built from it too (``cmpl-ID``,
``chatcmpl-ID``), as ``vllm serve`` builds them from the same header.

The API's POST routes take their id in :class:`gateway.api.direct.DirectRoutes`
and put the header on the responses they make (:func:`with_request_id`): no
wrapper around every chunk a stream sends. :class:`RequestIds`, the outermost
ASGI layer, does it for every other request.
"""

from __future__ import annotations

import itertools
import os
from typing import TypeVar

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import errors
from gateway.context import BAND_HEADER, LAST_EVENT_ID_HEADER, RESUMABLE_HEADER, context_of
from gateway.endpoints import DIRECT_PATHS, render

HEADER = b"x-request-id"
R = TypeVar("R", bound=Response)
MAX_LENGTH = 128

# This process's random part and a counter: unique across gateways and
# restarts, and cheaper than a uuid4 per request.
_PREFIX = os.urandom(6).hex() + "-"
_numbers = itertools.count(1)


def new_request_id() -> str:
    return f"{_PREFIX}{next(_numbers)}"


def request_id_of(scope: Scope) -> str:
    """This request's id (one is made if none was assigned yet)."""
    context = context_of(scope)
    if not context.request_id:
        context.request_id = new_request_id()
    return context.request_id


def assign(scope: Scope) -> tuple[str, errors.BadRequest | None]:
    """Give the request its id: the client's if valid, else a new one (and the
    400 to send). The same pass notes the band the request asks for
    (``gateway.api.bands`` checks it) and whether it asks for a resumable
    stream or resumes one (``gateway.api.resumable``): one walk of the
    headers, not several."""
    rid = None
    bad = None
    context = context_of(scope)
    for key, value in scope["headers"]:
        if key == HEADER:
            if rid is None and bad is None:
                try:
                    rid = check(value)
                except errors.BadRequest as exc:
                    bad = exc
        elif key == BAND_HEADER:
            context.band_header = value.decode("latin-1")
        elif key == RESUMABLE_HEADER:
            context.resumable = value.decode("latin-1")
        elif key == LAST_EVENT_ID_HEADER:
            context.last_event_id = value.decode("latin-1")
    if rid is None:
        rid = new_request_id()
    context.request_id = rid
    return rid, bad


def fits(text: str) -> bool:
    """Whether a client's id is 1 to 128 printable ASCII characters without spaces."""
    return 0 < len(text) <= MAX_LENGTH and text.isascii() and text.isprintable() and " " not in text


def check(value: bytes) -> str:
    """A client's id as text; 400 unless it :func:`fits`."""
    if value.isascii():
        text = value.decode("ascii")
        if fits(text):
            return text
    raise errors.BadRequest(
        f"X-Request-Id must be 1 to {MAX_LENGTH} printable ASCII characters without spaces."
    )


class RequestIds:
    """Gives each HTTP request but the API's POST routes its id, and returns it in the
    ``X-Request-Id`` header (those routes do both in ``DirectRoutes``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] == "POST" and scope["path"] in DIRECT_PATHS):
            await self.app(scope, receive, send)
            return
        rid, bad = assign(scope)
        if bad is not None:
            await with_request_id(render(bad, scope["path"]), scope)(scope, receive, send)
        else:
            await self.app(scope, receive, _adding_id(send, rid))


def with_request_id(response: R, scope: Scope) -> R:
    """``response`` with this request's ``X-Request-Id`` header."""
    response.raw_headers.append((HEADER, request_id_of(scope).encode()))
    return response


def _adding_id(send: Send, rid: str) -> Send:
    header = (HEADER, rid.encode())

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), header]
        await send(message)

    return send_with_id
