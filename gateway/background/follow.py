"""A background stream's events, read from the state store: any replica serves it.

``GET /v1/responses/{id}?stream=true&starting_after=N`` (and a ``POST`` with
``background`` and ``stream``), or a chat or completion request with
``Last-Event-ID: {id}:{N}``, gets the stored events numbered above ``N``,
then each new one as it is stored, and the stream ends after the last (it
has ended: completed, incomplete, failed or cancelled), framed as its kind
frames them (``gateway.background.kinds``). The process that runs it tells
its readers at once (:class:`Notices`); so do the store's notifications on
PostgreSQL (``gateway.background.listen``), for a reader on another replica.
Without them a reader looks every ``POLL_SECONDS``, and with them every
``LISTENING_POLL_SECONDS``, in case one is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from gateway.background.kinds import Kind
from gateway.state import State
from gateway.state.background import ENDED

POLL_SECONDS = 0.25
# Kept short: a pooler in transaction mode takes LISTEN and delivers nothing.
LISTENING_POLL_SECONDS = 1.0


class Notices:
    """New events stored by this process, per response: what wakes its readers."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[asyncio.Event]] = {}
        # Whether the store's notifications reach this process (listen.py).
        self.listening = False

    @property
    def poll_seconds(self) -> float:
        """Longest a reader waits before it looks at the store anyway."""
        return LISTENING_POLL_SECONDS if self.listening else POLL_SECONDS

    def tell(self, response_id: str) -> None:
        for event in self._waiting.get(response_id, ()):
            event.set()

    def tell_all(self) -> None:
        for waiting in self._waiting.values():
            for event in waiting:
                event.set()

    @contextlib.contextmanager
    def watch(self, response_id: str) -> Iterator[asyncio.Event]:
        """An event set whenever this process is told of ``response_id`` while in
        the block: watched from before a read, no notice after it goes unseen."""
        event = asyncio.Event()
        waiting = self._waiting.setdefault(response_id, set())
        waiting.add(event)
        try:
            yield event
        finally:
            waiting.discard(event)
            if not waiting:
                self._waiting.pop(response_id, None)

    async def wait(self, response_id: str, most: float) -> bool:
        """Until this process is told of ``response_id`` (True), or ``most`` seconds
        (False)."""
        with self.watch(response_id) as told:
            return await within(told, most)


async def within(event: asyncio.Event, most: float) -> bool:
    """Whether ``event`` is set within ``most`` seconds."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(most):
            await event.wait()
    return event.is_set()


async def opened(
    store: State, response_id: str, after: int, viewer: str | None, path: str
) -> tuple[str, list[tuple[int, bytes]]] | None:
    """The first read of a stream: None if ``viewer`` has no such stream of ``path``."""
    return await store.call(store.background.events, response_id, after, viewer, path)


async def follow(
    store: State,
    notices: Notices,
    kind: Kind,
    path: str,
    response_id: str,
    after: int,
    first: tuple[str, list[tuple[int, bytes]]],
    viewer: str | None,
) -> AsyncIterator[bytes]:
    """The events after ``after``, from ``first`` (an :func:`opened` read) on,
    to the stream's end."""
    status, events = first
    with notices.watch(response_id) as told:
        # The first read came before the watch: the next one comes at once.
        told.set()
        while True:
            for seq, data in events:
                yield kind.frame(response_id, seq, data)
                after = seq
            # The status was read before the events, in one transaction: an
            # ended one means every event was there to read.
            if status in ENDED and not events:
                closing = kind.closing(status)
                if closing:
                    yield closing
                return
            if not events:
                await within(told, notices.poll_seconds)
            told.clear()  # before the read: a notice after it wakes the next wait
            read = await store.call(store.background.events, response_id, after, viewer, path)
            if read is None:
                return  # expired, or deleted, under the reader
            status, events = read
