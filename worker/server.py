"""The worker's ZeroMQ loop: ROUTER socket in front of one :class:`worker.engine.Engine`.

Each ``Generate`` runs as its own asyncio task. Tasks do not send frames
themselves: they append their deltas to an outbox per gateway, and one
flush, scheduled with ``call_soon``, sends everything that piled up in this
turn of the event loop as one ``Deltas`` frame. vLLM's output handler wakes
every request of an engine step in the same turn, so the frame rate follows
the engine's step rate, not tokens times requests.

Which gateways are still there (heartbeats, silence, dropped connections) is
``worker.liveness``; who may connect, ``worker.curve``.
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

import msgspec
import zmq
import zmq.asyncio

from shared import curve_keys, logs, protocol
from shared.settings import WorkerSettings
from shared.zmqio import Reader
from worker.curve import start_authenticator
from worker.engine_api import ModelEngine
from worker.errors import RequestError, classify_engine_error
from worker.liveness import Gateway, Identity, Liveness, watch_connections
from worker.metrics_server import start_metrics_server

log = logging.getLogger(__name__)

# How long a drained worker's socket keeps trying to send what is queued on
# it, and waits for its gateways to answer its farewell.
DRAINED_LINGER_MS = 5000
FAREWELL_TIMEOUT_S = 5.0


class WorkerServer:
    """The ROUTER loop: each request its own task, its deltas out through the outbox."""

    def __init__(self, settings: WorkerSettings, engine: ModelEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.worker_id = settings.link.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.ctx = zmq.asyncio.Context()
        self.curve = curve_keys.worker_curve(settings.link)
        self.sock = make_router(self.ctx, self.curve)
        # Read and written as a plain socket from the loop's poller (shared.zmqio).
        self.raw: zmq.Socket[bytes] = zmq.Socket.shadow(self.sock.underlying)
        self.reader: Reader[list[bytes]] = Reader(self.raw, self._on_frames, multipart=True)
        self.encoder = protocol.encoder()
        self.decoder = protocol.worker_decoder()
        # By gateway and request id: two gateways may send the same id (a
        # client's X-Request-Id), and each aborts only its own.
        self.requests: dict[tuple[Identity, str], asyncio.Task[None]] = {}
        self.gateways: dict[Identity, Gateway] = {}
        self._flush_scheduled = False
        self.draining = False
        # Its drain ended with every request finished (drain), not cut short.
        self.drained = False
        # The gateways its farewell waits for, those that answered, and when all have.
        self._farewell_waiting: set[Identity] = set()
        self._farewells: set[Identity] = set()
        self._farewell_answered = asyncio.Event()
        self._stop = asyncio.Event()
        self.liveness = Liveness(self, engine, settings.link, self.worker_id, uuid.uuid4().hex)

    # -- lifecycle ---------------------------------------------------------

    async def serve(self) -> None:
        # The authenticator runs before bind: a CURVE socket with no ZAP handler
        # lets every client in.
        authenticator = start_authenticator(self.ctx, self.curve) if self.curve else None
        monitor = self.sock.get_monitor_socket(curve_keys.HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED)
        self.sock.bind(self.settings.link.bind)
        log.info(
            "worker %s bound %s (%s), serving %s",
            self.worker_id,
            self.settings.link.bind,
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
            asyncio.create_task(self.liveness.heartbeats(), name="heartbeat"),
            asyncio.create_task(
                watch_connections(monitor, self.liveness.after_disconnect),
                name="connection monitor",
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
            # A drained worker's last frames (the end of the requests it let
            # finish) may still be queued: give them time to leave. A second
            # signal means now.
            self.sock.close(DRAINED_LINGER_MS if self.drained else 0)
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
        beat = self.liveness.heartbeat()
        for identity in self.gateways:
            self.send(identity, beat)
        running = list(self.requests.values())
        if running:
            await asyncio.wait(running, timeout=self.settings.drain_timeout)
        if self.requests:
            log.warning("drain timeout: aborting %d requests", len(self.requests))
        else:
            self.drained = True
            await self._farewell()
        self._stop.set()

    async def _farewell(self) -> None:
        """Wait for each gateway to answer a farewell: it has then read every
        frame sent before it (a gateway's link drops what is still unread
        when the connection closes), or for FAREWELL_TIMEOUT_S."""
        self._flush()
        self._farewells = set()
        beat = msgspec.structs.replace(self.liveness.heartbeat(), farewell=True)
        waiting = set(self.gateways)
        for identity in waiting:
            self.send(identity, beat)
        self._farewell_waiting = waiting
        if waiting:
            try:
                async with asyncio.timeout(FAREWELL_TIMEOUT_S):
                    await self._farewell_answered.wait()
            except TimeoutError:
                log.info("%d gateways did not answer the farewell", len(waiting - self._farewells))

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
            gateway = self.gateways[identity] = Gateway(last_seen=time.monotonic())
            # Say hello at once so a new gateway need not wait a heartbeat period.
            self.send(identity, self.liveness.heartbeat())
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
                    self.cancel(identity, request_id, "its gateway asked")
            elif isinstance(message, protocol.Describe):
                self._describe(identity, message.model)
            elif isinstance(message, protocol.Ping) and message.farewell:
                self._farewells.add(identity)
                if self._farewell_waiting <= self._farewells:
                    self._farewell_answered.set()
            # A Ping otherwise only refreshes last_seen.

    def _describe(self, identity: Identity, model: str) -> None:
        """The model's tokenizer, for a gateway that routes by the engine's cache."""
        if model not in self.engine.served_model_names:
            return
        described = self.engine.describe_tokenizer()
        if described is None:
            log.info("a gateway asked for the tokenizer, which this engine cannot give")
            return
        tokenizer_json, chat_template, special_tokens = described
        self.send(
            identity,
            protocol.Tokenizer(
                model=model,
                tokenizer_json=tokenizer_json,
                chat_template=chat_template,
                special_tokens=special_tokens,
                lora=model if model in self.engine.loras else "",
            ),
        )

    def _start(self, identity: Identity, message: protocol.Generate) -> None:
        key = (identity, message.request_id)
        if key in self.requests:
            self.fail(identity, message.request_id, 400, "duplicate request id")
            return
        if message.model not in self.engine.served_model_names:
            self.fail(
                identity,
                message.request_id,
                404,
                f"The model `{message.model}` does not exist.",
                "model",
            )
            return
        if self.draining:
            # The gateway had not heard yet; 503 tells it to try another worker.
            self.fail(
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

    def cancel(self, identity: Identity, request_id: str, why: str) -> None:
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
                prompts = await self.engine.prepare(
                    message.kind, message.params, message.continuation
                )
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
            self.fail(identity, request_id, exc.status, exc.message, exc.param)
        except TimeoutError:
            log.info("request timed out: its deadline passed")
            self.fail(identity, request_id, 504, "request timed out")
        except asyncio.CancelledError:
            # Aborted by the gateway, or shutting down: vLLM's generate() aborts
            # its engine requests when cancelled, so no engine time is spent.
            pass
        except Exception as exc:  # an engine error must reach the client, not vanish
            status, text, param = classify_engine_error(exc)
            if status >= 500:
                log.exception("request %s failed", request_id)
            else:
                # Said here too: a request that ends early with nothing in
                # either log cannot be told from one that finished.
                log.info("the engine refused the request: %d %s", status, text)
            self.fail(identity, request_id, status, text, param)

    def _forget(self, key: tuple[Identity, str], task: asyncio.Task[None]) -> None:
        # Only this task's entry: a new request may reuse the id once it ended.
        if self.requests.get(key) is task:
            del self.requests[key]

    def requests_of(self, identity: Identity) -> list[str]:
        """The ids of the requests running for the gateway ``identity``."""
        return [rid for (gateway, rid) in self.requests if gateway == identity]

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
                self.send(identity, protocol.Deltas(items=items))

    def fail(
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
        self.send(identity, protocol.Failed(request_id, status, message, param, cause))

    def send(self, identity: Identity, message: protocol._Message) -> None:
        # ROUTER_MANDATORY is off: a message for a gateway that is gone, or
        # past the high-water mark, is dropped rather than blocking.
        try:
            self.raw.send_multipart([identity, self.encoder.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("send to %r failed: %s", identity, exc)
        finally:
            self.reader.after_send()


def make_router(
    ctx: zmq.asyncio.Context, curve: curve_keys.CurveServer | None
) -> zmq.asyncio.Socket:
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
