"""ZeroMQ links from this gateway process to the workers: one DEALER socket each.

A link only moves messages: it encodes what it is given, and hands every
decoded message it receives to a callback. What the messages mean is the
pool's business (``gateway.pool``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shared import protocol
from shared.keys import HANDSHAKE_FAILED, CurveClient, handshake_failure

log = logging.getLogger(__name__)

OnMessage = Callable[["WorkerLink", protocol.ToGateway], None]
OnLinkEvent = Callable[["WorkerLink"], None]

# libzmq gives up on a link whose key the worker refused; we dial again this
# often, so a gateway whose key is authorized later joins without a restart.
REDIAL_AFTER_REFUSAL = 10.0


class WorkerLink:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        identity: bytes,
        on_message: OnMessage,
        on_disconnect: OnLinkEvent | None = None,
        on_connect: OnLinkEvent | None = None,
        curve: CurveClient | None = None,
    ) -> None:
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        # Fail fast instead of queueing for a worker that is not connected yet:
        # the pool only sends to workers it has heard from.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if curve is not None:
            curve.apply(self.sock)
        self._encoder = protocol.encoder()
        self._decoder = protocol.gateway_decoder()
        self._on_message = on_message
        self._on_disconnect = on_disconnect
        self._on_connect = on_connect
        self._tasks: list[asyncio.Task[None]] = []
        # A failing handshake is logged once, not on every reconnect, until one succeeds.
        self._handshake_failing = False
        self._redial: asyncio.Task[None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        if on_disconnect is not None or on_connect is not None:
            # A crashed worker's TCP connection drops at once: learning that from
            # ZMQ's socket monitor beats waiting out the heartbeat timeout. And a
            # finished handshake is the first moment a message can be sent
            # (IMMEDIATE drops anything sent sooner), so the pool says hello then.
            # Attached before connect(): on loopback the handshake is that quick.
            # A failed handshake (wrong CURVE keys, CURVE on one side only) is
            # logged: the worker never turns healthy, and the log says why.
            # The monitor socket is inproc, written by libzmq itself; MAXMSGSIZE
            # does not apply to inproc pipes.
            self._monitor = self.sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED
            )
        self.sock.connect(address)

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._receive_loop(), name=f"link {self.address}"))
        if self._monitor is not None:
            self._tasks.append(
                asyncio.create_task(
                    self._monitor_loop(self._monitor), name=f"monitor {self.address}"
                )
            )

    def send(self, message: protocol.ToWorker) -> bool:
        """Queue ``message`` for the worker; False if it cannot be sent now.

        An asyncio socket's send returns a future; with NOBLOCK it is settled
        at once, and a failure (no connected peer: ``zmq.Again``, thanks to
        ``IMMEDIATE``) is read from it here rather than left unretrieved.
        """
        future = cast(
            "asyncio.Future[object]",
            self.sock.send(self._encoder.encode(message), flags=zmq.NOBLOCK, copy=False),
        )
        if not future.done():
            future.add_done_callback(self._log_late_failure)
            return True
        error = future.exception()
        if error is None:
            return True
        if not isinstance(error, zmq.Again):
            log.warning("send to %s failed: %s", self.address, error)
        return False

    def _log_late_failure(self, future: asyncio.Future[object]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning("send to %s failed: %s", self.address, future.exception())

    async def _receive_loop(self) -> None:
        while True:
            frame = await self.sock.recv(copy=False)
            try:
                message = self._decoder.decode(frame.buffer)
            except msgspec.DecodeError as exc:
                log.warning("dropping an undecodable frame from %s: %s", self.address, exc)
                continue
            try:
                self._on_message(self, message)
            except Exception:
                log.exception("handling a message from %s failed", self.address)

    async def _monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and self._on_disconnect:
                    self._on_disconnect(self)
                elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._handshake_failing = False
                    if self._on_connect:
                        self._on_connect(self)
                elif event["event"] & HANDSHAKE_FAILED:
                    if not self._handshake_failing:
                        self._handshake_failing = True
                        log.warning(
                            "handshake with worker %s failed: %s",
                            self.address,
                            handshake_failure(event["event"], event["value"]),
                        )
                    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH and not self._redial:
                        self._redial = asyncio.create_task(self._redial_later())
        finally:
            monitor.close(0)

    async def _redial_later(self) -> None:
        try:
            await asyncio.sleep(REDIAL_AFTER_REFUSAL)
            try:
                self.sock.disconnect(self.address)
            except zmq.ZMQError:
                pass  # already forgotten by libzmq
            self.sock.connect(self.address)
        finally:
            self._redial = None

    async def close(self) -> None:
        if self._redial is not None:
            self._tasks.append(self._redial)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self.sock.disable_monitor()
        if self._monitor is not None:
            self._monitor.close(0)
        self.sock.close(0)
