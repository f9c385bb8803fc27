"""The worker's ZeroMQ loop: ROUTER socket in front of one :class:`worker.engine.Engine`.

Each ``Generate`` runs as its own asyncio task. Tasks do not send frames
themselves: they append their deltas to an outbox per gateway, and one
flush, scheduled with ``call_soon``, sends everything that piled up in this
turn of the event loop as one ``Deltas`` frame. vLLM's output handler wakes
every request of an engine step in the same turn, so the frame rate follows
the engine's step rate, not tokens times requests.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from shared import keys, logs, protocol
from shared.settings import WorkerSettings
from shared.ticks import Ticks
from shared.zmqio import Reader
from worker.engine import Engine
from worker.sampling import RequestError

log = logging.getLogger(__name__)

# Identity frame of the gateway a request came from.
Identity = bytes

# Seconds after a dropped connection at which the gateways are probed again:
# libzmq removes the route a moment after it reports the drop (measured on
# loopback: at once 23 times in 30, within 50 ms the other 7).
DISCONNECT_PROBES = (0.05, 0.5, 2.0)


@dataclass
class _Gateway:
    last_seen: float
    outbox: list[protocol.Delta] = field(default_factory=list)


class WorkerServer:
    def __init__(self, settings: WorkerSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.worker_id = settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.incarnation = uuid.uuid4().hex
        self.ctx = zmq.asyncio.Context()
        self.curve = keys.worker_curve(settings)
        self.sock = make_router(self.ctx, self.curve)
        # Read and written as a plain socket from the loop's poller (shared.zmqio).
        self.raw: zmq.Socket[bytes] = zmq.Socket.shadow(self.sock.underlying)
        self.reader: Reader[list[bytes]] = Reader(self.raw, self._on_frames, multipart=True)
        self.encoder = protocol.encoder()
        self.decoder = protocol.worker_decoder()
        # By gateway and request id: two gateways may send the same id (a
        # client's X-Request-Id), and each aborts only its own.
        self.requests: dict[tuple[Identity, str], asyncio.Task[None]] = {}
        self.gateways: dict[Identity, _Gateway] = {}
        self._flush_scheduled = False
        self.draining = False
        self._stop = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------

    async def serve(self) -> None:
        # The authenticator runs before bind: a CURVE socket with no ZAP handler
        # lets every client in.
        authenticator = start_authenticator(self.ctx, self.curve) if self.curve else None
        monitor = self.sock.get_monitor_socket(keys.HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED)
        self.sock.bind(self.settings.bind)
        log.info(
            "worker %s bound %s (%s), serving %s",
            self.worker_id,
            self.settings.bind,
            "CURVE" if self.curve else "plaintext",
            self.engine.served_model_names,
        )
        if self.settings.metrics_port:
            start_metrics_server(self.settings.metrics_port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        self.reader.start()
        tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(
                watch_connections(monitor, self._after_disconnect), name="connection monitor"
            ),
        ]
        try:
            await self._stop.wait()
        finally:
            self.reader.stop()
            for task in tasks:
                task.cancel()
            for task in list(self.requests.values()):
                task.cancel()
            # Let the cancelled requests send their abort to the engine.
            await asyncio.sleep(0)
            if authenticator is not None:
                authenticator.stop()
            self.sock.disable_monitor()
            monitor.close(0)
            self.sock.close(0)
            self.ctx.term()

    def _on_signal(self) -> None:
        """First signal: drain. A second one: stop now."""
        if self.draining:
            log.warning(
                "second signal: stopping without waiting for %d requests", len(self.requests)
            )
            self._stop.set()
            return
        asyncio.get_running_loop().create_task(self.drain(), name="drain")

    async def drain(self) -> None:
        """Tell gateways to stop sending, let running requests finish, then stop."""
        self.draining = True
        log.info("draining: %d requests running", len(self.requests))
        beat = self._heartbeat()
        for identity in self.gateways:
            self._send(identity, beat)
        running = list(self.requests.values())
        if running:
            await asyncio.wait(running, timeout=self.settings.drain_timeout)
        if self.requests:
            log.warning("drain timeout: aborting %d requests", len(self.requests))
        self._stop.set()

    # -- receiving ---------------------------------------------------------

    def _on_frames(self, frames: list[bytes]) -> None:
        # [gateway identity, message, message, ...]: a gateway sends what it
        # queued in one event-loop turn as one ZeroMQ message.
        if len(frames) < 2:
            log.warning("dropping a message of %d frames", len(frames))
            return
        identity = frames[0]
        gateway = self.gateways.get(identity)
        if gateway is None:
            gateway = self.gateways[identity] = _Gateway(last_seen=time.monotonic())
            # Say hello at once so a new gateway need not wait a heartbeat period.
            self._send(identity, self._heartbeat())
        gateway.last_seen = time.monotonic()
        for body in frames[1:]:
            try:
                message = self.decoder.decode(body)
            except msgspec.DecodeError as exc:
                log.warning("dropping an undecodable frame from %r: %s", identity, exc)
                continue
            if isinstance(message, protocol.Generate):
                self._start(identity, message)
            elif isinstance(message, protocol.Abort):
                for request_id in message.request_ids:
                    self._cancel(identity, request_id, "its gateway asked")
            # Ping only refreshes last_seen.

    def _start(self, identity: Identity, message: protocol.Generate) -> None:
        key = (identity, message.request_id)
        if key in self.requests:
            self._fail(identity, message.request_id, 400, "duplicate request id")
            return
        if message.model not in self.engine.served_model_names:
            self._fail(
                identity,
                message.request_id,
                404,
                f"The model `{message.model}` does not exist.",
                "model",
            )
            return
        if self.draining:
            # The gateway had not heard yet; 503 tells it to try another worker.
            self._fail(
                identity,
                message.request_id,
                503,
                "worker is draining",
                cause=protocol.WORKER_DRAINING,
            )
            return
        task = asyncio.create_task(self._run(identity, message), name=message.request_id)
        self.requests[key] = task
        # Not a `finally` in _run: a task cancelled before its first step (an
        # Abort read in the same turn as its Generate) never runs its body,
        # and its entry would stay until the gateway went silent.
        task.add_done_callback(lambda _: self._forget(key, task))

    def _cancel(self, identity: Identity, request_id: str, why: str) -> None:
        task = self.requests.get((identity, request_id))
        if task is not None:
            with logs.for_request(request_id):
                log.info("aborting the request: %s", why)
            task.cancel()

    # -- running one request ----------------------------------------------

    async def _run(self, identity: Identity, message: protocol.Generate) -> None:
        request_id = message.request_id
        # Every log line about this request carries its id (shared.logs); the
        # task has its own copy of the context, so this ends with the task.
        logs.request_id.set(request_id)
        log.debug(
            "running a %s request for %r, engine priority %d",
            message.kind,
            identity,
            self.engine.engine_priority(message.priority),
        )
        try:
            if message.kind == "vllm":
                outputs = self.engine.passthrough(
                    request_id, message.params, message.model, message.priority
                )
            else:
                prompts = await self.engine.prepare(message.kind, message.params)
                outputs = self.engine.run(
                    request_id, prompts, message.trace, message.model, message.priority
                )
            timeout = message.deadline - time.time() if message.deadline else None
            if timeout is not None and timeout <= 0:
                raise RequestError(504, "request deadline passed before it started")
            async with asyncio.timeout(timeout):
                async for deltas in outputs:
                    self._queue(identity, deltas)
        except RequestError as exc:
            log.info("request refused: %d %s", exc.status, exc.message)
            self._fail(identity, request_id, exc.status, exc.message, exc.param)
        except TimeoutError:
            log.info("request timed out: its deadline passed")
            self._fail(identity, request_id, 504, "request timed out")
        except asyncio.CancelledError:
            # Aborted by the gateway, or shutting down: vLLM's generate() aborts
            # its engine requests when cancelled, so no engine time is spent.
            pass
        except Exception as exc:  # an engine error must reach the client, not vanish
            status, text, param = _classify_engine_error(exc)
            if status >= 500:
                log.exception("request %s failed", request_id)
            else:
                # Said here too: a request that ends early with nothing in
                # either log cannot be told from one that finished.
                log.info("the engine refused the request: %d %s", status, text)
            self._fail(identity, request_id, status, text, param)

    def _forget(self, key: tuple[Identity, str], task: asyncio.Task[None]) -> None:
        # Only this task's entry: a new request may reuse the id once it ended.
        if self.requests.get(key) is task:
            del self.requests[key]

    # -- sending -----------------------------------------------------------

    def _queue(self, identity: Identity, deltas: list[protocol.Delta]) -> None:
        gateway = self.gateways.get(identity)
        if gateway is None:
            return
        gateway.outbox.extend(deltas)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            # A context of its own: the flush is every request's, not this one's.
            asyncio.get_running_loop().call_soon(self._flush, context=contextvars.Context())

    def _flush(self) -> None:
        self._flush_scheduled = False
        for identity, gateway in self.gateways.items():
            if gateway.outbox:
                items, gateway.outbox = gateway.outbox, []
                self._send(identity, protocol.Deltas(items=items))

    def _fail(
        self,
        identity: Identity,
        request_id: str,
        status: int,
        message: str,
        param: str | None = None,
        cause: str | None = None,
    ) -> None:
        # Deltas queued before the failure go first, so the order holds.
        self._flush()
        self._send(identity, protocol.Failed(request_id, status, message, param, cause))

    def _send(self, identity: Identity, message: protocol._Message) -> None:
        # ROUTER_MANDATORY is off: a message for a gateway that is gone, or
        # past the high-water mark, is dropped rather than blocking.
        try:
            self.raw.send_multipart([identity, self.encoder.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("send to %r failed: %s", identity, exc)
        finally:
            self.reader.after_send()

    # -- heartbeats and dead gateways -------------------------------------

    def _heartbeat(self) -> protocol.Heartbeat:
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
            draining=self.draining,
            system_fingerprint=self.engine.system_fingerprint,
            pool=self.settings.pool,
            chat_parser=self.engine.chat_parser,
            reasoning_parser=self.engine.reasoning_parser,
        )

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval
        ticks = Ticks(interval, "worker", "gateways' silence")
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            # Woken far later than asked: this process was stalled (SIGSTOP, a
            # starved core), not its gateways silent. What they sent meanwhile
            # is still unread: judge silence on a later tick, once it is read.
            paused = ticks.late()
            if not paused:
                # Timers run before I/O in a loop turn: read what waits first.
                self.reader.read_ready()
            for identity, gateway in list(self.gateways.items()):
                if paused:
                    self._send(identity, self._heartbeat())
                elif now - gateway.last_seen > self.settings.gateway_timeout:
                    self._forget_gateway(identity)
                else:
                    self._send(identity, self._heartbeat())

    def _forget_gateway(self, identity: Identity) -> None:
        """The gateway is silent, likely gone: abort its requests, whose output
        nobody may read.

        Each still gets a 503: a gateway that was only starved or paused,
        not gone, reads it when it runs again and ends (or retries) the
        request, which would otherwise wait for output that never comes."""
        timeout = self.settings.gateway_timeout
        orphans = self._orphans(identity)
        log.warning(
            "gateway %r silent for %gs: aborting %d requests", identity, timeout, len(orphans)
        )
        for request_id in orphans:
            self._fail(
                identity,
                request_id,
                503,
                f"the worker dropped the request: it heard nothing from this gateway for "
                f"{timeout:g}s (--gateway-timeout)",
                cause=protocol.GATEWAY_SILENT,
            )
            self._cancel(identity, request_id, "its gateway went silent")
        del self.gateways[identity]

    def _orphans(self, identity: Identity) -> list[str]:
        return [rid for (gateway, rid) in self.requests if gateway == identity]

    # -- dropped connections -------------------------------------------------

    def _after_disconnect(self) -> None:
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
        if self.raw.closed:
            return  # a probe due after the worker stopped
        for identity in self._unreachable(list(self.gateways)):
            orphans = self._orphans(identity)
            # A gateway that stopped cleanly had none left here.
            level = logging.WARNING if orphans else logging.INFO
            log.log(level, "gateway %r disconnected: aborting %d requests", identity, len(orphans))
            for request_id in orphans:
                self._cancel(identity, request_id, "its gateway disconnected")
            del self.gateways[identity]

    def _unreachable(self, identities: list[Identity]) -> list[Identity]:
        """The gateways ZeroMQ has no connection to now (each reachable one gets a heartbeat)."""
        if not identities:
            return []
        beat = self.encoder.encode(self._heartbeat())
        gone = []
        # Only for the probe: otherwise a send to a gateway that is gone is dropped.
        self.raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            for identity in identities:
                try:
                    self.raw.send_multipart([identity, beat], zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.EHOSTUNREACH:
                        gone.append(identity)
                    # EAGAIN: connected, its queue full; it is not gone.
        finally:
            self.raw.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.reader.after_send()
        return gone


def make_router(ctx: zmq.asyncio.Context, curve: keys.CurveServer | None) -> zmq.asyncio.Socket:
    """The worker's ROUTER, not bound yet: limits on, and CURVE when it has keys."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # Bounds each frame. A peer can still send a message of many frames, which
    # libzmq holds whole before we see any of it: only CURVE keeps such a peer
    # out on an untrusted network.
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    # A gateway that vanished must not block us: drop what cannot be routed.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    if curve is not None:
        curve.apply(sock)
    return sock


class GatewayAuthenticator(AsyncioAuthenticator):
    """ZAP handler that lets in the gateways whose public keys are in a directory.

    The directory is read on every handshake (handshakes are rare: one per
    gateway connection), so adding or removing a key file takes effect without
    a restart. Its ZAP socket is inproc, written by libzmq only.
    """

    def __init__(self, ctx: zmq.asyncio.Context, curve: keys.CurveServer) -> None:
        super().__init__(ctx)
        self._curve = curve
        self._peer = ""
        self._warned: dict[bytes, float] = {}

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # Frame 3 of a ZAP request is the client's IP address, for the log.
        self._peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, _domain: str, client_key: bytes) -> bool:
        """True if ``client_key`` (Z85) is an authorized gateway's public key."""
        try:
            allowed = client_key in self._curve.authorized_keys()
        except (OSError, ValueError) as exc:
            log.error("cannot read --curve-gateway-keys-dir, refusing everyone: %s", exc)
            return False
        if not allowed and _first_in_a_minute(self._warned, client_key):
            log.warning(
                "ZAP denied a client from %s with unknown CURVE key %s (not in %s)",
                self._peer,
                client_key.decode(errors="replace"),
                self._curve.authorized_dir,
            )
        return allowed


def start_authenticator(ctx: zmq.asyncio.Context, curve: keys.CurveServer) -> GatewayAuthenticator:
    """Start ZAP for ``ctx``; call inside the running loop, before a CURVE socket binds."""
    authenticator = GatewayAuthenticator(ctx, curve)
    authenticator.start()
    authenticator.configure_curve_callback(credentials_provider=authenticator)
    return authenticator


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
        elif _first_in_a_minute(warned, b"handshake"):
            reason = keys.handshake_failure(event["event"], event["value"])
            log.warning("a client failed the handshake: %s", reason)


def _first_in_a_minute(last: dict[bytes, float], what: bytes) -> bool:
    """True at most once a minute per ``what``: a rejected peer retries every few seconds."""
    now = time.monotonic()
    if now - last.get(what, float("-inf")) < 60.0:
        return False
    if len(last) > 1024:  # many distinct keys: forget, rather than grow
        last.clear()
    last[what] = now
    return True


def start_metrics_server(port: int) -> None:
    """Serve the process's Prometheus registry, where vLLM records its ``vllm:*`` metrics."""
    import prometheus_client

    prometheus_client.start_http_server(port)
    log.info("metrics on :%d/metrics", port)


def _classify_engine_error(exc: Exception) -> tuple[int, str, str | None]:
    """(HTTP status, message, parameter) for an exception out of vLLM.

    vLLM raises its client errors (and plain ValueErrors for bad input) from
    inside ``generate``; those are the client's 400s, anything else is ours.
    """
    from vllm.exceptions import VLLMClientError, VLLMValidationError

    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, VLLMValidationError):
            return 400, str(cause), cause.parameter
        if isinstance(cause, VLLMClientError | ValueError):
            return 400, str(cause), None
        cause = cause.__cause__
    return 500, f"engine error: {type(exc).__name__}: {exc}", None
