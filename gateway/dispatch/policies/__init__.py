"""Routing policies: which of the eligible workers gets a request.

Every policy has one method, ``select(context) -> Worker``. The pool
calls it only with workers that are healthy, serve the requested model, are
not draining and have a free slot, so a policy only chooses among equals in
eligibility. Policies keep no per-request state, and per-key state only in a
bounded map (the memory of routing stays bounded whatever the traffic):

* ``least-load`` (default): power of two choices over each worker's load:
  its requests in flight from this gateway (exact, current) plus those of
  other gateways, as of its last heartbeat (``gateway.dispatch.policies.least_load``);
* ``prefix``: a session key or the conversation's start stays on the worker
  it was placed on (the least loaded, ties by rendezvous hashing), within a
  load bound (a multiple of the mean, or a few requests over it), so a
  conversation's turns reach the same vLLM prefix cache
  (``gateway.dispatch.policies.prefix``);
* ``round-robin``: in turn (``gateway.dispatch.policies.round_robin``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

if TYPE_CHECKING:
    from gateway.dispatch.workers import Worker


class RoutingContext(msgspec.Struct, frozen=True):
    # Eligible workers (never empty), in a stable order.
    candidates: Sequence[Worker]
    # Affinity key: a session key, or the start of the prompt; None if the
    # policy does not use one.
    key: str | None = None


class Policy(Protocol):
    # Whether the pool must compute ``RoutingContext.key`` for this policy.
    uses_key: bool

    def select(self, context: RoutingContext) -> Worker: ...


def load(worker: Worker) -> int:
    """A worker's load as this gateway sees it: own in-flight + other gateways' requests.

    Not own in-flight + the reported waiting count: that counts this gateway's
    queued requests twice, and from a heartbeat up to a second old, so the
    policy swings away from a worker whose queue has already drained.
    """
    return worker.in_flight + worker.others


def make_policy(name: str, load_factor: float, load_slack: int) -> Policy:
    from gateway.dispatch.policies.least_load import LeastLoad
    from gateway.dispatch.policies.prefix import PrefixAffinity
    from gateway.dispatch.policies.round_robin import RoundRobin

    if name == "least-load":
        return LeastLoad()
    if name == "prefix":
        return PrefixAffinity(load_factor, load_slack)
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r}: use least-load, prefix or round-robin")


POLICY_NAMES = ("least-load", "prefix", "round-robin")
