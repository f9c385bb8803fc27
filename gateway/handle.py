"""One attempt of a request on one worker, as the API code sees it: iterate, then close.

The pool (``gateway.pool``) makes a :class:`RequestHandle` when it sends a
request to a worker, and delivers to it, in order, whatever arrives for it:
the worker's ``Delta`` items (the last one carries ``usage``), or a
``Failed``, or a :class:`WorkerLost` when the worker went away. The handle
owns the request's deadline. Whoever holds it calls :meth:`RequestHandle.next`
until the end and :meth:`RequestHandle.close` once done (or gone).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway import errors
from shared import protocol

if TYPE_CHECKING:
    from gateway.models import Tier
    from gateway.workers import WorkerState


@dataclass(frozen=True, slots=True)
class WorkerLost:
    """The worker running a request went away; the request may be retried elsewhere."""

    reason: str


Item = protocol.Delta | protocol.Failed | WorkerLost

# Put in a request's inbox by its deadline timer: one timer per attempt is
# cheaper than a timeout scope around every wait for a delta.
_DEADLINE = object()


class Inbox:
    """What arrived for one request, in order: an ``asyncio.Queue`` for one
    reader and no bound, without the Queue's bookkeeping (it is made, filled
    and read once per request)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[object] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: object) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def peek(self) -> object | None:
        return self._items[0] if self._items else None

    def get_nowait(self) -> object:
        return self._items.popleft()

    async def get(self) -> object:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class RequestHandle:
    """One attempt of a request on one worker: its items in order, until close.

    ``next()`` returns what the worker sent and raises ``errors.Timeout`` once
    the request's deadline has passed. ``close()`` lets go of the request,
    aborting it on the worker if it is still running there; it may be called
    more than once.
    """

    def __init__(
        self,
        request_id: str,
        worker: WorkerState,
        deadline: float,
        release: Callable[[RequestHandle], None],
        tier: Tier,
        low_priority: bool = False,
    ) -> None:
        self.request_id = request_id
        self.worker = worker
        # A batch line's (admitted behind interactive requests).
        self.low_priority = low_priority
        # The pool it runs in, and since when (for the pool's mean request time).
        self.tier = tier
        self.started = time.monotonic()
        # Set once the worker has sent its last item (nothing to abort).
        self.finished = False
        # Set once its first delta is going out to the client as a stream: it
        # can no longer be retried elsewhere, so a worker that falls silent is
        # waited for (--stall-timeout) rather than given up at once.
        self.streaming = False
        self._inbox = Inbox()
        self._release = release
        self._timer = (
            asyncio.get_running_loop().call_later(
                deadline - time.time(), self._inbox.put_nowait, _DEADLINE
            )
            if deadline
            else None
        )

    def deliver(self, item: Item) -> None:
        """Called by the pool for each item that arrives for this request."""
        if type(item) is protocol.Delta:
            if item.usage is not None:
                self.finished = True
        else:  # Failed, WorkerLost: the last item either way
            self.finished = True
        self._inbox.put_nowait(item)

    async def next(self) -> Item:
        item = await self._inbox.get()
        if item is _DEADLINE:
            raise errors.Timeout("The request timed out.")
        return item  # type: ignore[return-value]

    def next_nowait(self) -> Item | None:
        """The next item if one is already here (None if not, or if the deadline is)."""
        item = self._inbox.peek()
        if item is None or item is _DEADLINE:
            return None
        return self._inbox.get_nowait()  # type: ignore[return-value]

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._release(self)
