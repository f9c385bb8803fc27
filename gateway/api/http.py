"""What a request needs of HTTP beyond its body's meaning: headers, the body, the deadline,
noticing that the client left, and a stream that always lets go of its request.

Used by :mod:`gateway.api.call`; plain Starlette and ASGI, nothing of the pool.
"""

from __future__ import annotations

import asyncio
import collections.abc
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from gateway import errors

# How long a request runs before a task watches for its client leaving.
DISCONNECT_GRACE = 0.02
TIMEOUT_HEADER = b"x-request-timeout"


def header(request: Request, name: bytes) -> str | None:
    """The value of the first header called ``name`` (lower case), or None.

    A scan of the raw ASGI list: cheaper than building Starlette's
    ``Headers`` for the two or three a request reads.
    """
    for key, value in request.scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be over ``limit`` bytes
    (``--max-body-bytes``)."""
    declared = header(request, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)  # without reading a byte of it
    # ASGI messages straight from the server: one, for most bodies.
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        if not message.get("more_body", False):
            return chunk if not chunks else b"".join([*chunks, chunk])
        chunks.append(chunk)


def _too_large(limit: int) -> errors.PayloadTooLarge:
    return errors.PayloadTooLarge(
        f"The request body is larger than this server's --max-body-bytes of {limit} bytes."
    )


def deadline(request: Request, default_timeout: float) -> float:
    """Unix time the request must finish by (0: none), from the header or the setting."""
    value = header(request, TIMEOUT_HEADER)
    timeout = default_timeout
    if value is not None:
        try:
            timeout = float(value)
        except ValueError:
            raise errors.BadRequest(
                f"X-Request-Timeout must be a number of seconds, not {value!r}."
            ) from None
        if not timeout > 0:
            raise errors.BadRequest("X-Request-Timeout must be positive.")
        if default_timeout:
            timeout = min(timeout, default_timeout)
    return time.time() + timeout if timeout else 0.0


class DisconnectWatch:
    """Cancels the current task if the client disconnects (then ``disconnected`` is set).

    The watcher task starts only after ``DISCONNECT_GRACE`` seconds: most
    requests to a fast worker are answered sooner, and never pay for it. A
    client that left earlier is seen as soon as the watcher starts.
    """

    def __init__(self, request: Request) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.disconnected = False
        self._receive = request.receive
        self._watcher: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(DISCONNECT_GRACE, self._start)

    def _start(self) -> None:
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        # The body has been read, so the next ASGI message is the disconnect.
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        self.task.cancel()

    def stop(self) -> None:
        self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()


class EventStream(StreamingResponse):
    """An SSE response that always lets go of its request.

    Starlette may never start the body generator (the client left between
    the first token and the response's first write), and then the
    generator's ``finally`` never runs: ``release`` is called instead, so
    the request is still aborted on the worker and counted.
    """

    def __init__(
        self,
        body: AsyncIterator[bytes],
        release: Callable[[], None],
        headers: dict[str, str],
    ) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            body = self.body_iterator
            assert isinstance(body, collections.abc.AsyncGenerator)
            await body.aclose()  # runs the generator's finally if it started
            self.release()  # else this lets go of the request
