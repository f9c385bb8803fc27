"""The workers as this gateway process sees them, and the requests in flight on them.

A worker is *healthy* while its heartbeats keep coming (``heartbeat_timeout``).
Its heartbeat says which models it serves and which incarnation it is: a new
incarnation means the process restarted and whatever we had in flight there
is gone. The pool fails such requests with 502 rather than leave a client
waiting for output that will never come.

Workers need not be up when the gateway starts: links reconnect on their own,
and a request that finds no healthy worker waits up to ``startup_timeout``
for one before it gets 503.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field

import zmq.asyncio

from gateway import errors
from gateway.transport import WorkerLink
from shared import protocol
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)

Item = protocol.Delta | protocol.Failed


@dataclass(eq=False)
class WorkerState:
    link: WorkerLink
    worker_id: str = ""
    incarnation: str = ""
    models: frozenset[str] = frozenset()
    last_heartbeat: float = 0.0
    healthy: bool = False
    draining: bool = False
    # Requests this gateway process has running there.
    in_flight: int = 0
    # What the worker last said about itself.
    running: int = 0
    waiting: int = 0
    capacity: int = 0
    max_model_len: int = 0
    requests: set[str] = field(default_factory=set)

    @property
    def address(self) -> str:
        return self.link.address


class RequestHandle:
    """One request in flight: the deltas and the failure a worker sends for it."""

    def __init__(self, pool: Pool, request_id: str, worker: WorkerState) -> None:
        self.pool = pool
        self.request_id = request_id
        self.worker = worker
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.finished = False

    async def next(self) -> Item:
        return await self.queue.get()

    def close(self) -> None:
        """Forget the request; if it is still running, abort it on the worker."""
        self.pool._release(self, abort=not self.finished)


class Pool:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.gateway_id = f"gw-{uuid.uuid4().hex[:12]}"
        self.ctx = zmq.asyncio.Context()
        self.workers: list[WorkerState] = []
        self.pending: dict[str, RequestHandle] = {}
        self._any_healthy = asyncio.Event()
        self._monitor: asyncio.Task[None] | None = None
        self.started_at = int(time.time())

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        identity = self.gateway_id.encode()
        for address in parse_addresses(self.settings.workers):
            link = WorkerLink(self.ctx, address, identity, self._on_message)
            self.workers.append(WorkerState(link=link))
            link.start()
        self._ping_all()
        self._monitor = asyncio.create_task(self._monitor_loop(), name="pool monitor")

    async def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for worker in self.workers:
            if worker.requests:
                worker.link.send(protocol.Abort(request_ids=list(worker.requests)))
        for worker in self.workers:
            await worker.link.close()
        self.ctx.term()

    # -- queries -----------------------------------------------------------

    def healthy_workers(self) -> list[WorkerState]:
        return [w for w in self.workers if w.healthy]

    def models(self) -> list[str]:
        return sorted({m for w in self.healthy_workers() for m in w.models})

    # -- requests ----------------------------------------------------------

    async def wait_for_worker(self) -> bool:
        """Wait up to ``startup_timeout`` for a healthy worker; whether there is one."""
        if not self._any_healthy.is_set():
            try:
                async with asyncio.timeout(self.settings.startup_timeout):
                    await self._any_healthy.wait()
            except TimeoutError:
                return False
        return True

    async def submit(
        self, kind: protocol.RequestKind, model: str, params: dict[str, object], deadline: float
    ) -> RequestHandle:
        worker = await self._select(model)
        request_id = uuid.uuid4().hex
        handle = RequestHandle(self, request_id, worker)
        message = protocol.Generate(
            request_id=request_id, model=model, kind=kind, params=params, deadline=deadline
        )
        if not worker.link.send(message):
            raise errors.NoWorker(f"worker {worker.address} is not reachable")
        self.pending[request_id] = handle
        worker.requests.add(request_id)
        worker.in_flight += 1
        return handle

    async def _select(self, model: str) -> WorkerState:
        if not await self.wait_for_worker():
            raise errors.NoWorker("No worker is available; try again later.")
        healthy = self.healthy_workers()
        candidates = [w for w in healthy if model in w.models and not w.draining]
        if not candidates:
            if healthy and not any(model in w.models for w in healthy):
                raise errors.ModelNotFound.for_model(model)
            raise errors.NoWorker(f"No worker for model `{model}` is available.")
        # Least in flight; ties broken at random so equal workers share the load.
        # (Routing policies proper come with gateway.policies.)
        least = min(w.in_flight for w in candidates)
        return random.choice([w for w in candidates if w.in_flight == least])

    def _release(self, handle: RequestHandle, abort: bool) -> None:
        if self.pending.pop(handle.request_id, None) is None:
            return
        worker = handle.worker
        worker.requests.discard(handle.request_id)
        worker.in_flight -= 1
        if abort and worker.healthy:
            worker.link.send(protocol.Abort(request_ids=[handle.request_id]))

    # -- messages from workers ---------------------------------------------

    def _on_message(self, link: WorkerLink, message: protocol.ToGateway) -> None:
        if isinstance(message, protocol.Deltas):
            for delta in message.items:
                handle = self.pending.get(delta.request_id)
                if handle is not None:
                    if delta.usage is not None:
                        handle.finished = True
                    handle.queue.put_nowait(delta)
        elif isinstance(message, protocol.Failed):
            handle = self.pending.get(message.request_id)
            if handle is not None:
                handle.finished = True
                handle.queue.put_nowait(message)
        elif isinstance(message, protocol.Heartbeat):
            self._on_heartbeat(self._worker_for(link), message)

    def _worker_for(self, link: WorkerLink) -> WorkerState:
        for worker in self.workers:
            if worker.link is link:
                return worker
        raise LookupError(link.address)

    def _on_heartbeat(self, worker: WorkerState, beat: protocol.Heartbeat) -> None:
        if beat.protocol_version != protocol.PROTOCOL_VERSION:
            if worker.healthy or not worker.worker_id:
                log.error(
                    "worker %s speaks protocol %d, we speak %d: not using it",
                    worker.address,
                    beat.protocol_version,
                    protocol.PROTOCOL_VERSION,
                )
            worker.worker_id = beat.worker_id
            worker.healthy = False
            return
        if worker.incarnation and beat.incarnation != worker.incarnation:
            log.warning("worker %s restarted (new incarnation)", worker.address)
            self._fail_requests(worker, "The worker serving this request restarted.")
        if not worker.healthy:
            log.info(
                "worker %s (%s) is up, serving %s", worker.address, beat.worker_id, beat.models
            )
        worker.worker_id = beat.worker_id
        worker.incarnation = beat.incarnation
        worker.models = frozenset(beat.models)
        worker.last_heartbeat = time.monotonic()
        worker.healthy = True
        worker.draining = beat.draining
        worker.running = beat.running
        worker.waiting = beat.waiting
        worker.capacity = beat.capacity
        worker.max_model_len = beat.max_model_len
        self._any_healthy.set()

    # -- liveness ----------------------------------------------------------

    def _ping_all(self) -> None:
        ping = protocol.Ping(gateway_id=self.gateway_id, sent_at=time.time())
        for worker in self.workers:
            worker.link.send(ping)

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            self._ping_all()
            now = time.monotonic()
            for worker in self.workers:
                silent = now - worker.last_heartbeat
                if worker.healthy and silent > self.settings.heartbeat_timeout:
                    log.warning(
                        "worker %s silent for %.1fs: marking it down", worker.address, silent
                    )
                    worker.healthy = False
                    self._fail_requests(
                        worker, "The worker serving this request stopped responding."
                    )
            if not self.healthy_workers():
                self._any_healthy.clear()

    def _fail_requests(self, worker: WorkerState, reason: str) -> None:
        for request_id in list(worker.requests):
            handle = self.pending.get(request_id)
            if handle is not None and not handle.finished:
                handle.finished = True
                handle.queue.put_nowait(protocol.Failed(request_id, 502, reason))


def parse_addresses(spec: str) -> list[str]:
    """``tcp://a:1,tcp://b:2`` (or bare ``host:port``) as a list of ZMQ addresses."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        out.append(part if "://" in part else f"tcp://{part}")
    if not out:
        raise ValueError("no worker addresses given")
    return out
