"""A background response's event stream, read from the state store: any replica serves it.

``GET /v1/responses/{id}?stream=true&starting_after=N`` (and a ``POST`` with
``background`` and ``stream``) sends the stored events numbered above ``N``,
then each new one as it is stored, and ends after the last (the response has
ended: completed, incomplete, failed or cancelled). The process that runs the
response tells its readers at once (:class:`Notices`); a reader on another
replica looks every ``POLL_SECONDS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from gateway.state import State
from gateway.state.background import ENDED

POLL_SECONDS = 0.25


class Notices:
    """New events stored by this process, per response: what wakes its readers."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[asyncio.Event]] = {}

    def tell(self, response_id: str) -> None:
        for event in self._waiting.get(response_id, ()):
            event.set()

    async def wait(self, response_id: str, most: float) -> None:
        """Until this process stores an event of ``response_id``, or ``most`` seconds."""
        event = asyncio.Event()
        waiting = self._waiting.setdefault(response_id, set())
        waiting.add(event)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(most):
                    await event.wait()
        finally:
            waiting.discard(event)
            if not waiting:
                self._waiting.pop(response_id, None)


def sse(data: bytes) -> bytes:
    """One stored event as vLLM's server and OpenAI frame it."""
    kind = str(json.loads(data).get("type", ""))
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def opened(
    store: State, response_id: str, after: int, viewer: str | None
) -> tuple[str, list[tuple[int, bytes]]] | None:
    """The first read of a stream: None if ``viewer`` has no such background response."""
    return await store.call(store.background.events, response_id, after, viewer)


async def follow(
    store: State,
    notices: Notices,
    response_id: str,
    after: int,
    first: tuple[str, list[tuple[int, bytes]]],
    viewer: str | None,
) -> AsyncIterator[bytes]:
    """The events after ``after``, from ``first`` (an :func:`opened` read) on,
    to the response's end."""
    status, events = first
    while True:
        for seq, data in events:
            yield sse(data)
            after = seq
        # The status was read before the events, in one transaction: an
        # ended one means every event was there to read.
        if status in ENDED and not events:
            return
        if not events:
            await notices.wait(response_id, POLL_SECONDS)
        read = await store.call(store.background.events, response_id, after, viewer)
        if read is None:
            return  # expired, or deleted, under the reader
        status, events = read
