"""Which gateways are still there: heartbeats out; silence and dropped connections in.

A worker tells every gateway it has heard from that it is alive, and how
loaded, with a ``Heartbeat`` every ``--heartbeat-interval``; a gateway tells
the worker with any message (a ``Ping`` when it has nothing else to send).
A gateway silent for ``--gateway-timeout``, or whose connection dropped, is
forgotten and its requests are aborted: nobody is left to read their output,
and the engine's time goes to requests someone reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shared import curve_keys, protocol
from shared.settings import WorkerLinkSettings
from shared.ticks import Ticks
from shared.zmqio import Reader
from worker.curve import first_in_a_minute
from worker.engine_api import ModelEngine

log = logging.getLogger(__name__)

# Identity frame of the gateway a request came from.
Identity = bytes

# Seconds after a dropped connection at which the gateways are probed again:
# libzmq removes the route a moment after it reports the drop (measured on
# loopback: at once 23 times in 30, within 50 ms the other 7).
DISCONNECT_PROBES = (0.05, 0.5, 2.0)


@dataclass
class Gateway:
    """A gateway the worker has heard from."""

    last_seen: float
    # What waits for this event-loop turn's flush to it (worker.server).
    outbox: list[protocol.Delta] = field(default_factory=list)


class Router(Protocol):
    """What liveness needs of the ROUTER loop (:class:`worker.server.WorkerServer`)."""

    @property
    def gateways(self) -> dict[Identity, Gateway]: ...
    @property
    def draining(self) -> bool: ...
    @property
    def raw(self) -> zmq.Socket[bytes]: ...
    @property
    def reader(self) -> Reader[list[bytes]]: ...
    @property
    def encoder(self) -> msgspec.msgpack.Encoder: ...

    def send(self, identity: Identity, message: protocol._Message) -> None: ...

    def requests_of(self, identity: Identity) -> list[str]: ...

    def fail(
        self,
        identity: Identity,
        request_id: str,
        status: int,
        message: str,
        param: str | None = None,
        cause: str | None = None,
    ) -> None: ...

    def cancel(self, identity: Identity, request_id: str, why: str) -> None: ...


class Liveness:
    """The heartbeats of one worker, and the end of the gateways that left it."""

    def __init__(
        self,
        router: Router,
        engine: ModelEngine,
        settings: WorkerLinkSettings,
        worker_id: str,
        incarnation: str,
    ) -> None:
        self.router = router
        self.engine = engine
        self.settings = settings
        self.worker_id = worker_id
        self.incarnation = incarnation

    def heartbeat(self) -> protocol.Heartbeat:
        running, waiting, kv_usage = self.engine.load()
        return protocol.Heartbeat(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            models=self.engine.served_model_names,
            running=running,
            waiting=waiting,
            kv_cache_usage=kv_usage,
            capacity=self.engine.max_num_seqs,
            max_model_len=self.engine.max_model_len,
            draining=self.router.draining,
            system_fingerprint=self.engine.system_fingerprint,
            pool=self.settings.pool,
            chat_parser=self.engine.chat_parser,
            reasoning_parser=self.engine.reasoning_parser,
            kv_events_port=self.engine.kv_events_port,
            kv_replay_port=self.engine.kv_replay_port,
            kv_block_size=self.engine.kv_block_size,
            gateways=len(self.router.gateways),
        )

    async def heartbeats(self) -> None:
        """Every interval: a heartbeat to each gateway, or its end when it is silent."""
        interval = self.settings.heartbeat_interval
        ticks = Ticks(interval, "worker", "gateways' silence")
        router = self.router
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            # Woken far later than asked: this process was stalled (SIGSTOP, a
            # starved core), not its gateways silent. What they sent meanwhile
            # is still unread: judge silence on a later tick, once it is read.
            paused = ticks.late()
            if not paused:
                # Timers run before I/O in a loop turn: read what waits first.
                router.reader.read_ready()
            for identity, gateway in list(router.gateways.items()):
                if paused:
                    router.send(identity, self.heartbeat())
                elif now - gateway.last_seen > self.settings.gateway_timeout:
                    self._forget_silent(identity)
                else:
                    router.send(identity, self.heartbeat())

    def _forget_silent(self, identity: Identity) -> None:
        """The gateway is silent, likely gone: abort its requests, whose output
        nobody may read.

        Each still gets a 503: a gateway that was only starved or paused,
        not gone, reads it when it runs again and ends (or retries) the
        request, which would otherwise wait for output that never comes."""
        timeout = self.settings.gateway_timeout
        orphans = self.router.requests_of(identity)
        log.warning(
            "gateway %r silent for %gs: aborting %d requests", identity, timeout, len(orphans)
        )
        for request_id in orphans:
            self.router.fail(
                identity,
                request_id,
                503,
                f"the worker dropped the request: it heard nothing from this gateway for "
                f"{timeout:g}s (--gateway-timeout)",
                cause=protocol.GATEWAY_SILENT,
            )
            self.router.cancel(identity, request_id, "its gateway went silent")
        del self.router.gateways[identity]

    def after_disconnect(self) -> None:
        """A connection dropped: a gateway that exited (crashed, killed) closes
        its connections at once, and its requests end now rather than after
        --gateway-timeout of silence.

        The event names a file descriptor, not a gateway: each known gateway
        is probed instead (a send that ZeroMQ cannot route). libzmq removes
        the route a few commands after the event, so the probe runs again
        shortly after; one not found gone falls to the silence rule."""
        loop = asyncio.get_running_loop()
        self._drop_unreachable_gateways()
        for delay in DISCONNECT_PROBES:
            loop.call_later(delay, self._drop_unreachable_gateways)

    def _drop_unreachable_gateways(self) -> None:
        router = self.router
        if router.raw.closed:
            return  # a probe due after the worker stopped
        for identity in self._unreachable(list(router.gateways)):
            orphans = router.requests_of(identity)
            # A gateway that stopped cleanly had none left here.
            level = logging.WARNING if orphans else logging.INFO
            log.log(level, "gateway %r disconnected: aborting %d requests", identity, len(orphans))
            for request_id in orphans:
                router.cancel(identity, request_id, "its gateway disconnected")
            del router.gateways[identity]

    def _unreachable(self, identities: list[Identity]) -> list[Identity]:
        """The gateways ZeroMQ has no connection to now (each reachable one gets a heartbeat)."""
        if not identities:
            return []
        raw = self.router.raw
        beat = self.router.encoder.encode(self.heartbeat())
        gone = []
        # Only for the probe: otherwise a send to a gateway that is gone is dropped.
        raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            for identity in identities:
                try:
                    raw.send_multipart([identity, beat], zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.EHOSTUNREACH:
                        gone.append(identity)
                    # EAGAIN: connected, its queue full; it is not gone.
        finally:
            raw.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.router.reader.after_send()
        return gone


async def watch_connections(
    monitor: zmq.asyncio.Socket, on_disconnect: Callable[[], None] = lambda: None
) -> None:
    """Act on the worker socket's monitor: a dropped connection calls
    ``on_disconnect``; clients failing the handshake (CURVE on one side only,
    say) are logged, once a minute.

    Which side notices a handshake mismatch first varies, and so does the
    event; a refused key is logged by the authenticator, with the key.
    """
    warned: dict[bytes, float] = {}
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())
        if event["event"] == zmq.EVENT_DISCONNECTED:
            on_disconnect()
        elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            continue
        elif first_in_a_minute(warned, b"handshake"):
            reason = curve_keys.handshake_failure(event["event"], event["value"])
            log.warning("a client failed the handshake: %s", reason)
