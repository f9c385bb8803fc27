"""Admission: which requests may go to a worker now, which wait, and which are refused.

A request goes to a worker with a free slot (fewer requests in flight from
this gateway than the capacity the worker reports, vLLM's
``max_num_seqs``, or ``--max-inflight-per-worker``), chosen among those by
the routing policy. When none has one, it waits in a bounded queue
(``--max-queue``) for up to ``--queue-timeout`` (or its deadline); past
either bound it is refused with 429. With no healthy worker at all, a
request waits ``--startup-timeout`` for one, then gets 503; a model no
healthy worker serves is a 404.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection

from gateway import errors, metrics
from gateway.policies import Policy, RoutingContext
from gateway.workers import Workers, WorkerState
from shared.settings import GatewaySettings


class Admission:
    def __init__(self, settings: GatewaySettings, workers: Workers, policy: Policy) -> None:
        self.settings = settings
        self.workers = workers
        self.policy = policy
        # Requests waiting in this process's queue.
        self.queued = 0
        self._slot_freed = asyncio.Condition()

    async def acquire(
        self,
        model: str,
        key: str | None,
        deadline: float,
        exclude: Collection[WorkerState],
        on_queued: Callable[[], object] | None = None,
    ) -> WorkerState:
        """A worker with a free slot for ``model``, chosen by the policy; queues if none has one
        (and calls ``on_queued`` then)."""
        if not self.workers.any_healthy and not await self.workers.wait_for_any():
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
        if on_queued is not None:
            on_queued()
        self.queued += 1
        metrics.QUEUE_DEPTH.inc()
        chosen = None
        try:
            async with self._slot_freed:
                while True:
                    free = self._free(self._eligible(model, exclude))
                    if free:
                        chosen = self.policy.select(RoutingContext(model, free, key))
                        return chosen
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
            if chosen is None:
                # Leaving without a slot (refused, cancelled, its client gone):
                # a wake-up meant for this request goes to the next one.
                self.wake(1)

    def wake(self, n: int | None = None) -> None:
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

    def _capacity(self, worker: WorkerState) -> int:
        """The smaller of what the worker reports and --max-inflight-per-worker (0s unset)."""
        reported, cap = worker.capacity, self.settings.max_inflight_per_worker
        if reported and cap:
            return min(reported, cap)
        return reported or cap or 1

    def _free(self, workers: list[WorkerState]) -> list[WorkerState]:
        return [w for w in workers if w.in_flight < self._capacity(w)]

    def _eligible(self, model: str, exclude: Collection[WorkerState]) -> list[WorkerState]:
        """Healthy, serving ``model``, not draining, not excluded; 404/503 if none."""
        eligible = [
            w
            for w in self.workers.by_address.values()
            if w.healthy and not w.draining and model in w.models and w not in exclude
        ]
        if eligible:
            return eligible
        # None: say why.
        healthy = self.workers.healthy()
        serving = [w for w in healthy if model in w.models]
        if not serving:
            if healthy and not any(w.draining for w in healthy):
                raise errors.ModelNotFound.for_model(model)
            metrics.REJECTED.labels("no_worker").inc()
            raise errors.NoWorker(f"No worker for model `{model}` is available.")
        metrics.REJECTED.labels("no_worker").inc()
        raise errors.NoWorker(f"No other worker for model `{model}` is available.")
