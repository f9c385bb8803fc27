"""The pool: this gateway process's one door to the workers.

``Pool.submit`` admits a request (``gateway.dispatch.admission``: a free slot, or the
queue, or a refusal), lets the routing policy pick the worker
(``gateway.dispatch.policies``), sends it there (``gateway.dispatch.transport``) and returns
the request's :class:`~gateway.dispatch.handle.RequestHandle`, whose other end (a
:class:`~gateway.dispatch.handle.Delivery`) the pool fills with whatever the worker
sends for it. The workers themselves, their heartbeats and their liveness
are ``gateway.dispatch.workers``, which tells the pool what happens to them
(:class:`~gateway.dispatch.workers.WorkerEvents`); where they are is
``gateway.dispatch.discovery``; model names and pools, ``gateway.dispatch.models``.

Callers use the pool's own methods, never its parts.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway import errors, metrics
from gateway.dispatch.admission import Admission
from gateway.dispatch.discovery import Discovery
from gateway.dispatch.handle import Answerer, Delivery, RequestHandle, WorkerLost
from gateway.dispatch.models import Models, Target, Tier
from gateway.dispatch.policies import Policy, make_policy
from gateway.dispatch.transport import WorkerLink
from gateway.dispatch.work import WorkOrder
from gateway.dispatch.workers import Worker, Workers
from shared import protocol
from shared.settings import AdmissionSettings, LinkSettings, RoutingSettings

log = logging.getLogger(__name__)

# How many released request ids the pool remembers (see Pool.submit).
RELEASED_IDS_KEPT = 10_000
# Seconds between looks for requests past their deadline: a request times out
# at most this late (``--request-timeout``, ``X-Request-Timeout``).
DEADLINE_TICK = 0.1


@dataclass(eq=False, slots=True)
class _Attempt:
    """One request on one worker, as the pool keeps it until its handle is closed."""

    request_id: str
    worker: Worker
    # The pool it runs in, and since when (for the pool's mean request time).
    tier: Tier
    delivery: Delivery
    # A batch line's (admitted behind interactive requests).
    low_priority: bool
    # Its API key's id (fair sharing).
    tenant: str | None = None
    # Unix time it is given up at (0: never).
    deadline: float = 0.0
    # A stream that may go on on another worker (``gateway.api.migration``).
    movable: bool = False
    started: float = field(default_factory=time.monotonic)


class Pool:
    def __init__(
        self,
        link: LinkSettings | None = None,
        admission: AdmissionSettings | None = None,
        routing: RoutingSettings | None = None,
        policy: Policy | None = None,
        models: Models | None = None,
    ) -> None:
        link = link or LinkSettings()
        routing = routing or RoutingSettings()
        # Model names, aliases, auto, pools and tiers (--config).
        self.names = models if models is not None else Models.from_file(routing.config)
        self.gateway_id = f"gw-{uuid.uuid4().hex[:12]}"
        self.started_at = int(time.time())
        # The workers tell the pool what happens to them (WorkerEvents below).
        self.workers = Workers(
            link, self.gateway_id, events=self, pool_of_address=self.names.pool_of_address()
        )
        self._policy = policy or make_policy(
            routing.policy, routing.prefix_load_factor, routing.prefix_load_slack, self.workers
        )
        self.admission = Admission(admission or AdmissionSettings(), self.workers, self._policy)
        self.discovery = Discovery(
            _worker_addresses(link, self.names), link.resolve_interval, self.workers.sync
        )
        # Requests sent to a worker and not yet closed, by the id the worker knows.
        self.pending: dict[str, _Attempt] = {}
        # Ids released lately: a retry, or a client reusing its X-Request-Id,
        # gets a suffixed id, so no late delta for the old one reaches it.
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._suffixes = itertools.count(1)
        # Interactive (not batch) requests on workers, and when one last
        # started or ended: the batch runner takes fewer slots while
        # interactive traffic is about.
        self.interactive_in_flight = 0
        # Never yet: infinitely long ago (not the monotonic clock's zero, which
        # is this machine's boot, minutes ago on a new one).
        self.last_interactive = -math.inf
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        log.info("gateway id %s", self.gateway_id)
        await self.discovery.resolve()
        self._tasks.append(asyncio.create_task(self.workers.monitor(), name="pool monitor"))
        self._tasks.append(asyncio.create_task(self._expire_overdue(), name="pool deadlines"))
        if self.discovery.changes:
            self._tasks.append(asyncio.create_task(self.discovery.loop(), name="pool resolve"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.workers.close()

    # -- queries -----------------------------------------------------------

    @property
    def uses_key(self) -> bool:
        """Whether requests need a routing key (the prefix policy's affinity)."""
        return self._policy.uses_key

    def resolve(
        self, model: str, raw: dict[str, Any], headers: Iterable[tuple[bytes, bytes]]
    ) -> Target:
        """The pools a request for ``model`` may run on (``gateway.dispatch.models``)."""
        return self.names.resolve(model, raw, headers)

    def listing(self, served: list[str]) -> list[dict[str, Any]]:
        """``/v1/models``' entries beyond the served models: aliases, the auto name."""
        return self.names.listing(served)

    @property
    def known_models(self) -> set[str]:
        return self.workers.known_models

    def healthy_workers(self) -> list[Worker]:
        return self.workers.healthy()

    def worker_count(self) -> int:
        """Worker addresses known, healthy or not."""
        return len(self.workers.by_address)

    def models(self) -> list[str]:
        return self.workers.models()

    def capacity(self) -> int:
        """Slots of the healthy workers, all pools together."""
        return self.admission.capacity()

    def interactive_since(self) -> float:
        """Seconds since this process last had an interactive request on a worker
        or waiting for one (0 while it has)."""
        if self.interactive_in_flight or self.admission.queued:
            return 0.0
        return time.monotonic() - self.last_interactive

    async def wait_for_worker(self) -> bool:
        return await self.workers.wait_for_any()

    # -- requests ----------------------------------------------------------

    async def submit(
        self,
        order: WorkOrder,
        exclude: Collection[str] = (),
        on_queued: Callable[[], object] | None = None,
    ) -> RequestHandle:
        """Admit the request, pick a worker, send it; raises a ``GatewayError`` if refused.

        The order's ``request_id`` becomes the id of the ``Generate`` (and
        vLLM's); if it is in use or was lately (a retry, a client's reused
        ``X-Request-Id``), a suffix ``~N`` keeps the two apart. ``exclude``:
        addresses of workers not to use (those a retry already failed on);
        ``on_queued``: called if the request has to wait for a slot.
        """
        worker, tier = await self.admission.acquire(order, exclude, on_queued)
        request_id = order.request_id
        low_priority, tenant = order.band == protocol.BATCH, order.tenant
        if request_id in self.pending or request_id in self._released:
            request_id = f"{request_id}~{next(self._suffixes)}"
        message = protocol.Generate(
            request_id=request_id,
            model=tier.model,
            kind=order.kind,
            params=order.params,
            deadline=order.deadline,
            trace=order.trace,
            # Its band, and in it its key's place by fair sharing (the
            # engine's queue holds every gateway's requests).
            priority=protocol.engine_priority(order.band, self.admission.rank(tenant)),
            continuation=order.continuation,
        )
        try:
            # Leaves at the end of this loop turn; if the connection turns out
            # to be gone, the worker is lost and the request retried elsewhere.
            worker.link.send(message)
        except OverflowError:
            self.admission.unused(tier, tenant)
            # msgpack holds 64-bit integers; JSON does not stop at that.
            raise errors.BadRequest(
                "The request holds an integer too large to handle (64 bits at most)."
            ) from None
        answered_by = Answerer(
            address=worker.address,
            incarnation=worker.incarnation,
            model=tier.model,
            pool=tier.pool or worker.pool,
            system_fingerprint=worker.system_fingerprint,
            chat_parser=worker.chat_parser,
        )
        # A handle releases its request once, however often it is closed.
        release = functools.partial(self._release, request_id)
        handle, delivery = RequestHandle.open(request_id, answered_by, release)
        self.pending[request_id] = _Attempt(
            request_id, worker, tier, delivery, low_priority, tenant, order.deadline, order.movable
        )
        if not low_priority:
            self.interactive_in_flight += 1
            self.last_interactive = time.monotonic()
        worker.requests.add(request_id)
        worker.in_flight += 1
        metrics.add(metrics.IN_FLIGHT)
        metrics.add(worker.in_flight_gauge)
        self.admission.started(tier)
        return handle

    def _release(self, request_id: str) -> None:
        """A handle was closed: forget it, abort it on its worker if it still runs there."""
        attempt = self.pending.pop(request_id)
        if not attempt.low_priority:
            self.interactive_in_flight -= 1
            self.last_interactive = time.monotonic()
        self._released[attempt.request_id] = None
        if len(self._released) > RELEASED_IDS_KEPT:
            self._released.popitem(last=False)
        worker = attempt.worker
        worker.requests.discard(attempt.request_id)
        worker.in_flight -= 1
        metrics.add(metrics.IN_FLIGHT, -1)
        metrics.add(worker.in_flight_gauge, -1)
        finished = attempt.delivery.finished
        if not finished and (worker.healthy or worker.stalled):
            worker.link.send(protocol.Abort(request_ids=[attempt.request_id]))
        # Only whole requests tell the pool how long one takes (not aborts).
        took = time.monotonic() - attempt.started if finished else None
        # Fair sharing charges what the engine computed, however it ended.
        computed = attempt.delivery.computed()
        tokens = computed.prompt_tokens + computed.completion_tokens if computed else None
        self.admission.finished(attempt.tier, took, attempt.tenant, tokens)

    def expire_overdue(self, now: float) -> None:
        """Tell every request past its deadline at ``now`` (Unix time) that it is."""
        for attempt in self.pending.values():
            if attempt.deadline and now >= attempt.deadline:
                attempt.delivery.expire()

    async def _expire_overdue(self) -> None:
        while True:
            await asyncio.sleep(DEADLINE_TICK)
            self.expire_overdue(time.time())

    # -- what the workers tell the pool (gateway.dispatch.workers.WorkerEvents) -------

    def worker_output(self, link: WorkerLink, message: protocol.ToGateway) -> None:
        """Deltas and failures, to the handles of the requests they are for."""
        # Only from the worker the request went to: one that was lost (hung,
        # then back) may still send for an id whose request went elsewhere.
        if isinstance(message, protocol.Deltas):
            pending = self.pending
            for delta in message.items:
                attempt = pending.get(delta.request_id)
                if attempt is not None and attempt.worker.link is link:
                    attempt.delivery.deliver(delta)
        elif isinstance(message, protocol.Failed):
            attempt = self.pending.get(message.request_id)
            if attempt is not None and attempt.worker.link is link:
                attempt.delivery.deliver(message)

    def worker_lost(self, worker: Worker, reason: str, may_return: bool) -> tuple[list[str], int]:
        """Fail the worker's requests (the API retries those it can); which ids
        failed, and how many were kept waiting for it.

        ``may_return``: it is only silent, so it may be stalled rather than
        gone. Then what a retry cannot help waits for it: a stream under way
        (it cannot move) and a request no other worker could take now (its
        retry would only be a 503: with one worker, any stall would fail every
        request that had not started streaming)."""
        failed: list[str] = []
        kept = 0
        for request_id in list(worker.requests):
            attempt = self.pending.get(request_id)
            if attempt is None or attempt.delivery.finished:
                continue
            delivery = attempt.delivery
            if may_return and (delivery.streaming or not self.admission.serves(attempt.tier)):
                kept += 1
                continue
            delivery.deliver(WorkerLost(reason))
            failed.append(request_id)
        return failed, kept

    def worker_up(self) -> None:
        self.admission.wake()

    def worker_draining(self, worker: Worker) -> None:
        """Hand the draining worker's movable streams over to other workers
        rather than keep its drain (a restart) waiting for them: each is
        failed as the worker would fail a new request (503, draining), which
        moves it on, and aborted there. A stream whose pool has no other
        worker to take it now stays and finishes where it is."""
        handed: list[str] = []
        for request_id in list(worker.requests):
            attempt = self.pending.get(request_id)
            if attempt is None or not attempt.movable:
                continue
            delivery = attempt.delivery
            # (``streaming``: its worker parses its tools or reasoning, which cannot move.)
            if delivery.finished or delivery.streaming or not self.admission.serves(attempt.tier):
                continue
            delivery.deliver(
                protocol.Failed(
                    request_id=request_id,
                    status=503,
                    message="worker is draining",
                    cause=protocol.WORKER_DRAINING,
                )
            )
            handed.append(request_id)
        if handed:
            log.info("worker %s drains: %d requests move on", worker.address, len(handed))
            worker.link.send(protocol.Abort(request_ids=handed))


def _worker_addresses(link: LinkSettings, models: Models) -> str:
    """``--workers``, and the addresses the config's pools list (those alone when
    ``--workers`` is left at its default)."""
    listed = models.addresses()
    if not listed:
        return link.workers
    if link.workers == LinkSettings().workers:
        return ",".join(listed)
    return ",".join([link.workers, *listed])
