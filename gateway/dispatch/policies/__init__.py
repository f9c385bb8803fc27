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
* ``round-robin``: in turn (``gateway.dispatch.policies.round_robin``);
* ``kv``: the worker whose engine holds the most of the prompt's leading
  blocks, as the engines' KV cache events say, within the prefix policy's load
  bound; ``prefix``'s choice where no engine publishes events
  (``gateway.dispatch.policies.kv_cache``).

A client's hint (the ``X-Session-Id`` header, OpenAI's ``prompt_cache_key``)
is honoured under every policy: ``least-load`` and ``round-robin`` place a
hinted request as ``prefix`` does (:class:`Hinted`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

if TYPE_CHECKING:
    from gateway.dispatch.kv_events import KvEvents
    from gateway.dispatch.tokens import PromptTokenizer
    from gateway.dispatch.work import WorkOrder
    from gateway.dispatch.workers import Worker


class RoutingContext(msgspec.Struct, frozen=True):
    # Eligible workers (never empty), in a stable order.
    candidates: Sequence[Worker]
    # Affinity key: a client's hint (session header, prompt_cache_key), else a
    # session key or the start of the prompt; None if the policy does not use one.
    key: str | None = None
    # The model the candidates run it as (their tier's), and the request (the
    # kv policy reads its prompt).
    model: str = ""
    order: WorkOrder | None = None

    @property
    def hinted(self) -> bool:
        """Whether ``key`` is the client's own hint."""
        return self.order is not None and self.order.hinted


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


class Hinted:
    """A keyless policy whose hinted requests are placed by affinity (``prefix``)."""

    uses_key = False

    def __init__(self, policy: Policy, affinity: Policy) -> None:
        self.policy = policy
        self.affinity = affinity

    def select(self, context: RoutingContext) -> Worker:
        if context.hinted:
            return self.affinity.select(context)
        return self.policy.select(context)


def make_policy(
    name: str, load_factor: float, load_slack: int, caches: CacheView | None = None
) -> Policy:
    """The policy named ``name``; ``caches``: what the kv policy reads (the pool's workers)."""
    from gateway.dispatch.policies.kv_cache import CacheAware
    from gateway.dispatch.policies.least_load import LeastLoad
    from gateway.dispatch.policies.prefix import PrefixAffinity
    from gateway.dispatch.policies.round_robin import RoundRobin

    if name == "least-load":
        return Hinted(LeastLoad(), PrefixAffinity(load_factor, load_slack))
    if name == "prefix":
        return PrefixAffinity(load_factor, load_slack)
    if name == "round-robin":
        return Hinted(RoundRobin(), PrefixAffinity(load_factor, load_slack))
    if name == "kv":
        if caches is None:
            raise ValueError("the kv policy reads the workers' caches: pass them")
        return CacheAware(caches, PrefixAffinity(load_factor, load_slack))
    raise ValueError(f"unknown routing policy {name!r}: use {', '.join(POLICY_NAMES)}")


class CacheView(Protocol):
    """What the kv policy reads of the workers: their KV events and tokenizers
    (which they fetch only once it says it wants them)."""

    wants_tokenizers: bool

    @property
    def kv(self) -> KvEvents: ...

    @property
    def tokenizers(self) -> Mapping[str, PromptTokenizer]: ...

    @property
    def adapters(self) -> Mapping[str, str]:
        """Models that are LoRA adapters -> the name their engines' KV events carry."""
        ...


POLICY_NAMES = ("least-load", "prefix", "round-robin", "kv")
