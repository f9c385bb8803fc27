"""ZeroMQ links from this gateway process to the workers: one DEALER socket each.

A link only moves messages: it encodes what it is given, and hands every
decoded message it receives to a callback (:class:`LinkEvents`; read by
:class:`shared.zmqio.Reader` from the event loop's poller). What the messages
mean is the pool's business (``gateway.dispatch.pool``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from shared import protocol
from shared.curve_keys import HANDSHAKE_FAILED, CurveClient, handshake_failure
from shared.zmqio import Reader

log = logging.getLogger(__name__)

OnMessage = Callable[["WorkerLink", protocol.ToGateway], None]
OnLinkEvent = Callable[["WorkerLink"], None]


class LinkEvents(msgspec.Struct, frozen=True):
    """What a link calls: with each message it receives; when its connection
    drops or a send is refused (``on_disconnect``); when its handshake is done
    (``on_connect``)."""

    on_message: OnMessage
    on_disconnect: OnLinkEvent | None = None
    on_connect: OnLinkEvent | None = None


# libzmq gives up on a link whose key the worker refused; we dial again this
# often, so a gateway whose key is authorized later joins without a restart.
REDIAL_AFTER_REFUSAL = 10.0


class WorkerLink:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        identity: bytes,
        events: LinkEvents,
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
        # To recognise our own pings coming back (a TCP self-connect).
        self._worker_decoder = protocol.worker_decoder()
        self._gateway_id = identity.decode(errors="replace")
        self._on_message = events.on_message
        self._on_disconnect = events.on_disconnect
        self._on_connect = events.on_connect
        self._reader: Reader[bytes] = Reader(self.sock, self._on_frame, multipart=False)
        # When the last message of any kind came: a worker streaming output
        # lives, even if its heartbeat is late behind that output.
        self.last_received = 0.0
        self._outbox: list[bytes] = []
        # A failing handshake is logged once, not on every reconnect, until one succeeds.
        self._handshake_failing = False
        self._redial: asyncio.Task[None] | None = None
        self._monitor: Reader[list[bytes]] | None = None
        if events.on_disconnect is not None or events.on_connect is not None:
            # A crashed worker's TCP connection drops at once: learning that from
            # ZMQ's socket monitor beats waiting out the heartbeat timeout. And a
            # finished handshake is the first moment a message can be sent
            # (IMMEDIATE drops anything sent sooner), so the pool says hello then.
            # Attached before connect(): on loopback the handshake is that quick.
            # A failed handshake (wrong CURVE keys, CURVE on one side only) is
            # logged: the worker never turns healthy, and the log says why.
            # The monitor socket is inproc, written by libzmq itself; MAXMSGSIZE
            # does not apply to inproc pipes.
            monitor = self.sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED
            )
            self._monitor = Reader(monitor, self._on_monitor_event, multipart=True)
        self.sock.connect(address)

    def start(self) -> None:
        """Start reading (call inside the running loop)."""
        self._reader.start()
        if self._monitor is not None:
            self._monitor.start()

    def send(self, message: protocol.ToWorker) -> None:
        """Queue ``message`` for the worker.

        Messages queued in one turn of the event loop leave together, as the
        frames of one ZeroMQ message: a send wakes libzmq's I/O thread, and
        under load one wake per turn costs much less than one per request.
        If they cannot leave (with ``IMMEDIATE``, a worker that is not
        connected refuses at once), ``on_disconnect`` is called: the pool
        treats the worker as lost and retries its requests elsewhere.
        """
        self._outbox.append(self._encoder.encode(message))
        if len(self._outbox) == 1:
            # A context of its own: the flush serves every request of this
            # turn, so its log lines must not carry one request's id.
            asyncio.get_running_loop().call_soon(self._flush, context=contextvars.Context())

    def _flush(self) -> None:
        frames, self._outbox = self._outbox, []
        if not frames or self.sock.closed:
            return
        try:
            if len(frames) == 1:
                self.sock.send(frames[0], zmq.NOBLOCK)
            else:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if not isinstance(exc, zmq.Again):
                log.warning("send to %s failed: %s", self.address, exc)
            if self._on_disconnect is not None:
                self._on_disconnect(self)
        finally:
            self._reader.after_send()

    def read_ready(self) -> None:
        """Handle every message waiting on the socket now."""
        self._reader.read_ready()

    def _on_frame(self, frame: bytes) -> None:
        try:
            message = self._decoder.decode(frame)
        except msgspec.DecodeError as exc:
            if self._is_own_ping(frame):
                self._connected_to_itself()
                return
            log.warning("dropping an undecodable frame from %s: %s", self.address, exc)
            return
        self.last_received = time.monotonic()
        self._on_message(self, message)

    def _is_own_ping(self, frame: bytes) -> bool:
        try:
            message = self._worker_decoder.decode(frame)
        except msgspec.DecodeError:
            return False
        return isinstance(message, protocol.Ping) and message.gateway_id == self._gateway_id

    def _connected_to_itself(self) -> None:
        """TCP's self-connect: dialing a port in the kernel's ephemeral range
        where nothing listens yet, the socket may get that very port as its
        own end and connect to itself. It then holds the worker's port (the
        worker cannot bind it) and hears its own pings. Hang up and dial again."""
        log.warning(
            "the link to %s connected to itself (TCP self-connect: nothing listened there "
            "yet and the port is in the kernel's ephemeral range): dialing again; "
            "a worker port below net.ipv4.ip_local_port_range avoids this",
            self.address,
        )
        try:
            self.sock.disconnect(self.address)
        except zmq.ZMQError:
            pass  # already forgotten by libzmq
        self.sock.connect(self.address)

    def _on_monitor_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_DISCONNECTED and self._on_disconnect:
            # What the worker sent before it went (a drained worker's last
            # tokens) is read first: it is not lost with the connection.
            self._reader.read_ready()
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
        self._flush()  # what was queued this turn (the pool's last aborts)
        self._reader.stop()
        if self._redial is not None:
            self._redial.cancel()
            try:
                await self._redial
            except asyncio.CancelledError:
                pass
        if self._monitor is not None:
            self._monitor.stop()
            self.sock.disable_monitor()
            self._monitor.sock.close(0)
        self.sock.close(0)
