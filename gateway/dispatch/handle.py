"""One attempt of a request on one worker: the API side reads it, the pool's side fills it.

The pool (``gateway.dispatch.pool``) opens a :class:`RequestHandle` when it sends a
request to a worker (:meth:`RequestHandle.open`) and keeps the other end, a
:class:`Delivery`: whatever arrives for the request goes in there, in order:
the worker's ``Delta`` items (the last one carries ``usage``), or a
``Failed``, or a :class:`WorkerLost` when the worker went away.

Whoever holds the handle reads those items (``async for item in handle``,
or :meth:`RequestHandle.next`) until the last one, then calls
:meth:`RequestHandle.close` once done (or gone). The handle says who
answered (:class:`Answerer`) without handing out the worker itself. Once
the pool finds the request past its deadline it calls
:meth:`Delivery.expire`, and the reader's next wait raises
``errors.Timeout``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Protocol

import msgspec

from gateway import errors
from shared import protocol


class WorkerLost(msgspec.Struct, frozen=True):
    """The worker running a request went away; the request may be retried elsewhere."""

    reason: str


Item = protocol.Delta | protocol.Failed | WorkerLost


class Answerer(msgspec.Struct, frozen=True):
    """Who answers a request, as of when it was sent: what its response headers,
    trace, metrics and cached entry say about it."""

    # The worker's address: its name in headers, logs and metrics.
    address: str
    # Which run of the worker process (a restart is a new one).
    incarnation: str
    # The served model name the worker knows the request by (a substitute's,
    # when it spilled over to a later tier).
    model: str
    # The pool that runs it: the tier's, or for a name the config does not
    # declare (a LoRA adapter) its worker's; "" without a config.
    pool: str
    system_fingerprint: str | None
    # Its chats stream as under a vLLM tool or reasoning parser (sse.Chat.chunk).
    chat_parser: bool


class Delivery(Protocol):
    """The pool's end of a handle: what it puts in, and what it needs to know."""

    @property
    def finished(self) -> bool:
        """The worker sent the request's last item: nothing left to abort there."""
        ...

    @property
    def streaming(self) -> bool:
        """Its first delta went out to the client as a stream: it can no longer
        be retried elsewhere, so a worker that falls silent is waited for
        (``--stall-timeout``) rather than given up at once."""
        ...

    def deliver(self, item: Item) -> None:
        """One item that arrived for the request, in order."""
        ...

    def computed(self) -> protocol.Usage | None:
        """What the engine has computed for the request (:func:`computed`)."""
        ...

    def expire(self) -> None:
        """The request's deadline passed: its reader's next wait raises ``errors.Timeout``."""
        ...


# Put in a request's inbox once it is past its deadline (the pool looks for
# those a few times a second: cheaper than a timer per attempt, or a timeout
# scope around every wait for a delta).
_DEADLINE = object()


def _is_last(item: object) -> bool:
    """Whether ``item`` ends the request: a failure, or the delta with its usage."""
    return type(item) is not protocol.Delta or item.usage is not None


class _Inbox:
    """What arrived for one request, in order (the :class:`Delivery` the pool
    holds): an ``asyncio.Queue`` for one reader and no bound, without the
    Queue's bookkeeping (it is made, filled and read once per request)."""

    __slots__ = (
        "_items",
        "_waiter",
        "completion_tokens",
        "expired",
        "finished",
        "prompt_tokens",
        "streaming",
        "usage",
    )

    def __init__(self) -> None:
        self._items: collections.deque[object] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self.finished = False
        self.streaming = False
        self.expired = False
        # What the worker said the engine computed: the prompt and each
        # token as it came, then the whole count (the last delta's usage).
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.usage: protocol.Usage | None = None

    def deliver(self, item: Item) -> None:
        if type(item) is protocol.Delta:
            if item.usage is not None:
                self.usage = item.usage
                self.finished = True
            else:
                self.completion_tokens += item.num_tokens
                self.prompt_tokens += item.prompt_tokens
        else:
            self.finished = True
        self.put_nowait(item)

    def computed(self) -> protocol.Usage | None:
        """The request's usage once it came, else the tokens counted so far
        (None: none yet): what a request that ends early is billed for."""
        if self.usage is not None:
            return self.usage
        if self.prompt_tokens or self.completion_tokens:
            return protocol.Usage(self.prompt_tokens, self.completion_tokens)
        return None

    def expire(self) -> None:
        if not self.expired:
            self.expired = True
            self.put_nowait(_DEADLINE)

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

    ``async for item in handle`` yields what the worker sent, up to and
    including the last item (the delta with ``usage``, a ``Failed`` or a
    :class:`WorkerLost`); like :meth:`next`, it raises ``errors.Timeout``
    once the pool found the request past its deadline. ``close()`` lets go of the
    request, aborting it on the worker if it is still running there; it may
    be called more than once.
    """

    __slots__ = ("_inbox", "_read_last", "_release", "answered_by", "request_id")

    def __init__(
        self,
        request_id: str,
        answered_by: Answerer,
        inbox: _Inbox,
        release: Callable[[], None],
    ) -> None:
        # The id the worker knows it by (the client's, or with a ``~N`` suffix).
        self.request_id = request_id
        self.answered_by = answered_by
        self._inbox = inbox
        self._release: Callable[[], None] | None = release
        self._read_last = False

    @classmethod
    def open(
        cls, request_id: str, answered_by: Answerer, release: Callable[[], None]
    ) -> tuple[RequestHandle, Delivery]:
        """A handle, and the end the pool delivers to; ``release`` is called
        once, on the first :meth:`close`."""
        inbox = _Inbox()
        return cls(request_id, answered_by, inbox, release), inbox

    @property
    def finished(self) -> bool:
        """The worker has sent the last item (it may not have been read yet)."""
        return self._inbox.finished

    def computed(self) -> protocol.Usage | None:
        """What the engine has computed for this attempt: its usage once the
        worker sent it, else the prompt and the tokens delivered so far
        (None: nothing yet). A client gone or a stream cut is billed this."""
        return self._inbox.computed()

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Item:
        if self._read_last:
            raise StopAsyncIteration
        return await self.next()

    async def next(self) -> Item:
        item = await self._inbox.get()
        if item is _DEADLINE:
            raise errors.Timeout("The request timed out.")
        if _is_last(item):
            self._read_last = True
        return item  # type: ignore[return-value]

    def next_nowait(self) -> Item | None:
        """The next item if one is already here (None if not, or if the deadline is)."""
        item = self._inbox.peek()
        if item is None or item is _DEADLINE:
            return None
        if _is_last(item):
            self._read_last = True
        return self._inbox.get_nowait()  # type: ignore[return-value]

    def mark_streaming(self) -> None:
        """Its first delta is going out to the client as a stream (see
        :attr:`Delivery.streaming`)."""
        self._inbox.streaming = True

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()
