"""The workers as this gateway process sees them, admission, and the requests in flight.

Workers come from ``--workers``: ``tcp://host:port`` entries whose host names
are resolved again every ``--resolve-interval`` seconds, so the DNS name of a
Kubernetes headless Service yields one worker per pod as pods come and go.

A worker is *healthy* while its heartbeats keep coming. It stops being so
when they stop for ``--heartbeat-timeout`` (a hung or partitioned worker) or
at once when its TCP connection drops (a crashed one). Its heartbeat says
which models it serves, how loaded it is, how many requests it takes at
once, and its incarnation: a new incarnation means the process restarted and
whatever we had in flight there is gone. Requests on a worker that is lost
get a :class:`WorkerLost` item, which the API turns into a retry on another
worker when nothing was sent to the client yet.

Admission: a request goes to a worker with a free slot (fewer requests in
flight than the capacity the worker reports, vLLM's ``max_num_seqs``). When
none has one, it waits in a bounded queue (``--max-queue``) for up to
``--queue-timeout``; past either bound it is refused with 429. With no
healthy worker at all, a request waits ``--startup-timeout`` for one, then
gets 503; a model no healthy worker serves is a 404.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import itertools
import logging
import socket
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import zmq

from gateway import errors, metrics
from gateway.policies import Policy, RoutingContext, make_policy
from gateway.transport import WorkerLink
from shared import keys, protocol
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerLost:
    """The worker running a request went away; the request may be retried elsewhere."""

    reason: str


Item = protocol.Delta | protocol.Failed | WorkerLost


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
    kv_cache_usage: float = 0.0
    capacity: int = 0
    max_model_len: int = 0
    # Requests it runs or queues for other gateways, as of its last heartbeat.
    others: int = 0
    system_fingerprint: str | None = None
    requests: set[str] = field(default_factory=set)
    # No longer listed by DNS: closed once idle.
    retired: bool = False

    @property
    def address(self) -> str:
        return self.link.address

    @property
    def key(self) -> str:
        """Stable name for hashing (prefix policy) and metrics labels."""
        return self.link.address


class Inbox:
    """What a worker sent for one request, in order: an ``asyncio.Queue`` for
    one reader and no bound, without the Queue's bookkeeping (it is made,
    filled and read once per request)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[Item] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Item:
        return self._items.popleft()

    async def get(self) -> Item:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class RequestHandle:
    """One request in flight: what the worker sends for it, in order."""

    def __init__(self, pool: Pool, request_id: str, worker: WorkerState) -> None:
        self.pool = pool
        self.request_id = request_id
        self.worker = worker
        self.queue = Inbox()
        self.finished = False
        # Called once on close (the attempt's deadline timer, if any, is cancelled).
        self.on_close: Callable[[], object] | None = None

    async def next(self) -> Item:
        return await self.queue.get()

    def close(self) -> None:
        """Forget the request; if it is still running, abort it on the worker."""
        if self.on_close is not None:
            self.on_close()
        self.pool._release(self, abort=not self.finished)


class Pool:
    def __init__(self, settings: GatewaySettings, policy: Policy | None = None) -> None:
        self.settings = settings
        self.policy = policy or make_policy(settings.policy, settings.prefix_load_factor)
        self.gateway_id = f"gw-{uuid.uuid4().hex[:12]}"
        # Request ids: this process's random part and a counter (unique across
        # gateways and restarts, and cheaper than a uuid4 per request).
        self._id_prefix = self.gateway_id[3:] + "-"
        self._request_numbers = itertools.count(1)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.workers: dict[str, WorkerState] = {}
        self.pending: dict[str, RequestHandle] = {}
        # Every model a worker has said it serves (metrics label only these).
        self.known_models: set[str] = set()
        self.started_at = int(time.time())
        self.queued = 0
        self._specs = parse_addresses(settings.workers)
        self._curve = keys.gateway_curve(settings)  # None: plaintext links
        self._any_healthy = asyncio.Event()
        self._slot_freed = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        log.info("gateway id %s", self.gateway_id)
        await self._resolve()
        self._tasks.append(asyncio.create_task(self._monitor_loop(), name="pool monitor"))
        if any(_needs_resolution(spec) for spec in self._specs):
            self._tasks.append(asyncio.create_task(self._resolve_loop(), name="pool resolve"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for worker in self.workers.values():
            if worker.requests:
                worker.link.send(protocol.Abort(request_ids=list(worker.requests)))
            await worker.link.close()
        self.ctx.term()

    # -- queries -----------------------------------------------------------

    def healthy_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.healthy]

    def models(self) -> list[str]:
        return sorted({m for w in self.healthy_workers() for m in w.models})

    async def wait_for_worker(self) -> bool:
        """Wait up to ``startup_timeout`` for a healthy worker; whether there is one."""
        if not self._any_healthy.is_set():
            try:
                async with asyncio.timeout(self.settings.startup_timeout):
                    await self._any_healthy.wait()
            except TimeoutError:
                return False
        return True

    # -- admission and routing ---------------------------------------------

    def _capacity(self, worker: WorkerState) -> int:
        """The smaller of what the worker reports and --max-inflight-per-worker (0s unset)."""
        set_limits = [n for n in (worker.capacity, self.settings.max_inflight_per_worker) if n]
        return min(set_limits, default=1)

    def _eligible(self, model: str, exclude: Collection[WorkerState]) -> list[WorkerState]:
        """Healthy, serving ``model``, not draining, not excluded; 404/503 if none."""
        eligible = [
            w
            for w in self.workers.values()
            if w.healthy and not w.draining and model in w.models and w not in exclude
        ]
        if eligible:
            return eligible
        # None: say why.
        healthy = self.healthy_workers()
        serving = [w for w in healthy if model in w.models]
        if not serving:
            if healthy and not any(w.draining for w in healthy):
                raise errors.ModelNotFound.for_model(model)
            metrics.REJECTED.labels("no_worker").inc()
            raise errors.NoWorker(f"No worker for model `{model}` is available.")
        metrics.REJECTED.labels("no_worker").inc()
        raise errors.NoWorker(f"No other worker for model `{model}` is available.")

    async def _acquire(
        self, model: str, key: str | None, deadline: float, exclude: Collection[WorkerState]
    ) -> WorkerState:
        if not await self.wait_for_worker():
            metrics.REJECTED.labels("no_worker").inc()
            raise errors.NoWorker("No worker is available; try again later.")
        free = self._free(self._eligible(model, exclude))
        if free and not self.queued:
            return self.policy.select(RoutingContext(model, free, key))
        if self.queued >= self.settings.max_queue:
            metrics.REJECTED.labels("queue_full").inc()
            raise errors.Overloaded(
                "Too many requests are waiting; try again shortly.", retry_after=1
            )
        wait = self.settings.queue_timeout
        if deadline:
            wait = min(wait, deadline - time.time())
        give_up = time.monotonic() + wait
        self.queued += 1
        metrics.QUEUE_DEPTH.inc()
        try:
            async with self._slot_freed:
                while True:
                    free = self._free(self._eligible(model, exclude))
                    if free:
                        return self.policy.select(RoutingContext(model, free, key))
                    remaining = give_up - time.monotonic()
                    if remaining <= 0:
                        metrics.REJECTED.labels("queue_timeout").inc()
                        raise errors.Overloaded(
                            "Timed out waiting for a free worker; try again shortly.", retry_after=1
                        )
                    try:
                        async with asyncio.timeout(remaining):
                            await self._slot_freed.wait()
                    except TimeoutError:
                        continue
        finally:
            self.queued -= 1
            metrics.QUEUE_DEPTH.dec()

    def _free(self, workers: list[WorkerState]) -> list[WorkerState]:
        return [w for w in workers if w.in_flight < self._capacity(w)]

    async def submit(
        self,
        kind: protocol.RequestKind,
        model: str,
        params: dict[str, object],
        deadline: float,
        key: str | None = None,
        exclude: Collection[WorkerState] = (),
    ) -> RequestHandle:
        """Admit the request, pick a worker, send it; raises a ``GatewayError`` if refused."""
        worker = await self._acquire(model, key, deadline, exclude)
        request_id = f"{self._id_prefix}{next(self._request_numbers)}"
        message = protocol.Generate(
            request_id=request_id, model=model, kind=kind, params=params, deadline=deadline
        )
        try:
            # Leaves at the end of this loop turn; if the connection turns out
            # to be gone, the worker is lost and the request retried elsewhere.
            worker.link.send(message)
        except OverflowError:
            # msgpack holds 64-bit integers; JSON does not stop at that.
            raise errors.BadRequest(
                "The request holds an integer too large to handle (64 bits at most)."
            ) from None
        handle = RequestHandle(self, request_id, worker)
        self.pending[request_id] = handle
        worker.requests.add(request_id)
        worker.in_flight += 1
        metrics.IN_FLIGHT.inc()
        metrics.child(metrics.WORKER_IN_FLIGHT, worker.key).inc()
        return handle

    def _release(self, handle: RequestHandle, abort: bool) -> None:
        if self.pending.pop(handle.request_id, None) is None:
            return
        worker = handle.worker
        worker.requests.discard(handle.request_id)
        worker.in_flight -= 1
        metrics.IN_FLIGHT.dec()
        metrics.child(metrics.WORKER_IN_FLIGHT, worker.key).dec()
        if abort and worker.healthy:
            worker.link.send(protocol.Abort(request_ids=[handle.request_id]))
        self._wake(1)

    def _wake(self, n: int | None = None) -> None:
        """Let ``n`` queued requests (all if None) look for a free slot again."""
        if not self.queued:
            return

        async def notify() -> None:
            async with self._slot_freed:
                if n is None:
                    self._slot_freed.notify_all()
                else:
                    self._slot_freed.notify(n)

        asyncio.get_running_loop().create_task(notify())

    # -- messages from workers ---------------------------------------------

    def _on_message(self, link: WorkerLink, message: protocol.ToGateway) -> None:
        if isinstance(message, protocol.Deltas):
            pending = self.pending
            for delta in message.items:
                handle = pending.get(delta.request_id)
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
            worker = self.workers.get(link.address)
            if worker is not None and worker.link is link:
                self._on_heartbeat(worker, message)

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
            self._fail_requests(worker, "the worker restarted")
        if not worker.healthy:
            log.info(
                "worker %s (%s) is up, serving %s", worker.address, beat.worker_id, beat.models
            )
        if beat.draining and not worker.draining:
            log.info("worker %s is draining", worker.address)
        worker.worker_id = beat.worker_id
        worker.incarnation = beat.incarnation
        worker.models = frozenset(beat.models)
        self.known_models.update(beat.models)
        worker.last_heartbeat = time.monotonic()
        was_healthy, worker.healthy = worker.healthy, True
        worker.draining = beat.draining
        worker.system_fingerprint = beat.system_fingerprint or None
        worker.running = beat.running
        worker.waiting = beat.waiting
        # The worker's count includes this gateway's own requests, which
        # in_flight already knows exactly and at once: keep only the rest.
        worker.others = max(0, beat.running + beat.waiting - worker.in_flight)
        worker.kv_cache_usage = beat.kv_cache_usage
        worker.capacity = beat.capacity
        worker.max_model_len = beat.max_model_len
        self._any_healthy.set()
        labels = worker.key
        metrics.WORKER_HEALTHY.labels(labels).set(1)
        metrics.WORKER_RUNNING.labels(labels).set(beat.running)
        metrics.WORKER_WAITING.labels(labels).set(beat.waiting)
        metrics.WORKER_KV_USAGE.labels(labels).set(beat.kv_cache_usage)
        if not was_healthy:
            self._wake()

    def _on_connect(self, link: WorkerLink) -> None:
        # The worker answers a gateway's first message with a heartbeat at once.
        link.send(protocol.Ping(gateway_id=self.gateway_id, sent_at=time.time()))

    def _on_disconnect(self, link: WorkerLink) -> None:
        worker = self.workers.get(link.address)
        if worker is not None and worker.link is link and worker.healthy:
            self._lose(worker, "its connection dropped")

    # -- liveness ----------------------------------------------------------

    def _lose(self, worker: WorkerState, reason: str) -> None:
        if worker.healthy:
            log.warning("worker %s lost: %s", worker.address, reason)
        worker.healthy = False
        metrics.WORKER_HEALTHY.labels(worker.key).set(0)
        self._fail_requests(worker, f"the worker was lost: {reason}")
        if not self.healthy_workers():
            self._any_healthy.clear()

    def _ping_all(self) -> None:
        ping = protocol.Ping(gateway_id=self.gateway_id, sent_at=time.time())
        for worker in self.workers.values():
            worker.link.send(ping)

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            self._ping_all()
            now = time.monotonic()
            for worker in list(self.workers.values()):
                silent = now - worker.last_heartbeat
                if worker.healthy and silent > self.settings.heartbeat_timeout:
                    self._lose(worker, f"silent for {silent:.1f}s")
                if worker.retired and not worker.requests:
                    await self._remove(worker)

    def _fail_requests(self, worker: WorkerState, reason: str) -> None:
        for request_id in list(worker.requests):
            handle = self.pending.get(request_id)
            if handle is not None and not handle.finished:
                handle.finished = True
                handle.queue.put_nowait(WorkerLost(reason))

    # -- discovery ---------------------------------------------------------

    async def _resolve(self) -> None:
        addresses: set[str] = set()
        for spec in self._specs:
            addresses.update(await resolve(spec))
        for address in addresses - self.workers.keys():
            link = WorkerLink(
                self.ctx,
                address,
                self.gateway_id.encode(),
                self._on_message,
                on_disconnect=self._on_disconnect,
                on_connect=self._on_connect,
                curve=self._curve,
            )
            self.workers[address] = WorkerState(link=link)
            link.start()  # it says hello (a ping) once its handshake is done
            log.info("worker address %s added", address)
        for address in self.workers.keys() - addresses:
            worker = self.workers[address]
            if not worker.retired:
                log.info("worker address %s no longer resolves: retiring it", address)
                worker.retired = True

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resolve_interval)
            try:
                await self._resolve()
            except Exception:
                log.exception("resolving worker addresses failed")

    async def _remove(self, worker: WorkerState) -> None:
        del self.workers[worker.address]
        metrics.WORKER_HEALTHY.labels(worker.key).set(0)
        await worker.link.close()
        if not self.healthy_workers():
            self._any_healthy.clear()


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


def _needs_resolution(address: str) -> bool:
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname:
        return False
    try:
        ipaddress.ip_address(parts.hostname)
    except ValueError:
        return True
    return False


async def resolve(address: str) -> list[str]:
    """A ``tcp://name:port`` address as one address per IPv4 (else IPv6) address of name.

    Other forms (IP addresses, ``ipc://``) are returned as they are. A name
    that does not resolve yet yields nothing: its workers join when it does.
    """
    if not _needs_resolution(address):
        return [address]
    parts = urlsplit(address)
    host, port = parts.hostname or "", parts.port
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("cannot resolve %s: %s", host, exc)
        return []
    v4 = sorted({str(info[4][0]) for info in infos if info[0] == socket.AF_INET})
    if v4:
        return [f"tcp://{ip}:{port}" for ip in v4]
    v6 = sorted({str(info[4][0]) for info in infos if info[0] == socket.AF_INET6})
    return [f"tcp://[{ip}]:{port}" for ip in v6]
