"""A ZeroMQ socket read from the asyncio loop's own poller, without a future per message.

pyzmq's asyncio sockets make a future, and wake a coroutine, for every
message received, and check the socket's events again after every send,
a cost the gateway paid per request (docs/benchmark-history.md). A
:class:`Reader` registers the socket's file descriptor with the event loop
once and, whenever it signals, receives every message that is ready with
NOBLOCK and hands each to a callback, all in one loop callback.

ZeroMQ's descriptor is edge-triggered: it signals when the socket's state
changed, and any call on the socket, a send included, may consume that
signal while a message waits. So whoever sends on the socket calls
:meth:`Reader.after_send`, which looks at ``ZMQ_EVENTS`` and schedules a
read if a message is waiting. Sends go through the plain (synchronous)
socket with NOBLOCK: they never block, the caller decides what a full queue
means.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from typing import Generic, TypeVar, cast

import zmq

log = logging.getLogger(__name__)

T = TypeVar("T", bytes, list[bytes])

# Messages read per loop callback before other callbacks get a turn.
BATCH = 256
# Plain ints: pyzmq's flag enums build a new enum member on every ``&``.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)


class Reader(Generic[T]):
    """Calls ``on_message`` with each message ``sock`` receives (frames if ``multipart``)."""

    def __init__(
        self, sock: zmq.Socket[bytes], on_message: Callable[[T], None], multipart: bool
    ) -> None:
        self.sock = sock
        self._on_message: Callable[[T], None] = on_message
        self._recv = sock.recv_multipart if multipart else sock.recv
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)
        self._schedule()  # whatever arrived before the reader was added

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None

    def after_send(self) -> None:
        """Call after sending on the socket: the send may have taken the descriptor's signal."""
        if self._loop is not None and self._readable():
            self._schedule()

    def read_ready(self) -> None:
        """Handle what is waiting now, before this loop turn ends (e.g. before
        judging a peer silent: its messages may be queued, not yet read)."""
        while self._loop is not None and self._readable():
            self._drain()

    def _readable(self) -> bool:
        return bool(cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN)

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            # Not in the caller's context: what the drain reads is no one request's.
            self._loop.call_soon(self._drain, context=contextvars.Context())

    def _drain(self) -> None:
        self._scheduled = False
        recv = self._recv
        for _ in range(BATCH):
            if self._loop is None:
                return  # stopped by a callback
            try:
                # Asking first is cheaper than the zmq.Again raised at the end.
                if not self._readable():
                    return
                message = recv(_NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ENOTSOCK:
                    return  # closed
                log.warning("receive failed: %s", exc)
                return
            try:
                self._on_message(message)  # type: ignore[arg-type]  # T follows multipart
            except Exception:
                log.exception("handling a ZeroMQ message failed")
        self._schedule()  # more may be waiting: give other callbacks a turn first
