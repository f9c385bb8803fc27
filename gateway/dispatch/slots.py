"""Which workers may take a request for a pool's tier now, and how many slots each has.

Admission's view of the workers (``gateway.dispatch.admission``): a worker runs a
tier's requests when it is healthy, not draining, serves the tier's model
(and pool) and is not excluded (a retry's earlier workers); its slots are
the smaller of what it reports (vLLM's ``max_num_seqs``) and
``--max-inflight-per-worker``. When no worker runs any of a request's tiers,
``live_tiers`` says why: 503 (none up now, or its declared pool is
starting) or 404 (a name nobody declared).
"""

from __future__ import annotations

from collections.abc import Collection

from gateway import errors, metrics
from gateway.dispatch.models import Target, Tier
from gateway.dispatch.workers import Worker, Workers
from shared.settings import AdmissionSettings


class Slots:
    def __init__(self, settings: AdmissionSettings, workers: Workers) -> None:
        self.settings = settings
        self.workers = workers

    def capacity_of(self, worker: Worker) -> int:
        """The smaller of what the worker reports and --max-inflight-per-worker (0s unset)."""
        reported, cap = worker.capacity, self.settings.max_inflight_per_worker
        if reported and cap:
            return min(reported, cap)
        return reported or cap or 1

    @staticmethod
    def runs(worker: Worker, tier: Tier, exclude: Collection[str]) -> bool:
        """Whether ``worker`` may take a request for ``tier`` now (slots aside);
        ``exclude``: addresses of workers not to use."""
        return (
            worker.healthy
            and not worker.draining
            and tier.model in worker.models
            and (not tier.pool or worker.pool == tier.pool)
            and worker.address not in exclude
        )

    def serves(self, tier: Tier) -> bool:
        """Whether any worker may take a request for ``tier`` now (slots aside)."""
        return any(self.runs(w, tier, ()) for w in self.workers.by_address.values())

    def serving(self, tier: Tier, exclude: Collection[str]) -> list[Worker]:
        return [w for w in self.workers.by_address.values() if self.runs(w, tier, exclude)]

    def free(self, tier: Tier, exclude: Collection[str]) -> list[Worker]:
        return [w for w in self.serving(tier, exclude) if w.in_flight < self.capacity_of(w)]

    def live_tiers(self, target: Target, exclude: Collection[str]) -> list[Tier]:
        """The target's tiers that have a worker to run on; 404/503 if none has."""
        workers = self.workers.by_address.values()
        tiers = [t for t in target.tiers if any(self.runs(w, t, exclude) for w in workers)]
        if tiers:
            return tiers
        # None: say why.
        model = target.model
        healthy = self.workers.healthy()
        serving = [w for w in healthy if any(t.model in w.models for t in target.tiers)]
        if serving:
            metrics.REJECTED.labels("no_worker").inc()
            raise errors.NoWorker(f"No other worker for model `{model}` is available.")
        if target.declared or model in self.workers.known_models:
            # Its pool is starting (or down): it will be served, so not a 404.
            metrics.REJECTED.labels("no_worker").inc()
            raise self.not_ready(target)
        if healthy and not any(w.draining for w in healthy):
            raise errors.ModelNotFound.for_model(model)
        metrics.REJECTED.labels("no_worker").inc()
        raise errors.NoWorker(f"No worker for model `{model}` is available.")

    def not_ready(self, target: Target) -> errors.ModelNotReady:
        served_before = target.model in self.workers.known_models
        return errors.ModelNotReady.for_model(target.model, served_before)
