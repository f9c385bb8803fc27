"""The workers as this gateway process sees them: what their heartbeats say, and whether they live.

A worker is healthy while it is heard from. It is lost at once when its TCP
connection drops, or after ``--heartbeat-timeout`` of silence (heartbeats or
output). A heartbeat says which models it serves, its capacity, the other
gateways' load on it and its incarnation: a new one means it restarted and lost
what we had in flight. What happens is told to one :class:`WorkerEvents` (the
pool), which fails a lost worker's requests for the API to retry. A silent
worker may only be stalled, so what a retry cannot help (streams under way,
requests no other worker could take) waits up to ``--stall-timeout`` and
carries on, every token delivered, if it is heard from again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import zmq
from prometheus_client import Gauge

from gateway import metrics
from gateway.dispatch.kv_events import KvEvents
from gateway.dispatch.tokens import PromptTokenizer
from gateway.dispatch.transport import LinkEvents, WorkerLink
from shared import curve_keys, protocol
from shared.settings import LinkSettings
from shared.ticks import Ticks

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Worker:
    """One worker as this gateway process knows it: its link, what its last
    heartbeat said, its health and this process's requests on it."""

    link: WorkerLink
    worker_id: str = ""
    incarnation: str = ""
    models: frozenset[str] = frozenset()
    # Its pool (--config): as it says, or as the config places its address.
    pool: str = ""
    last_heartbeat: float = 0.0
    healthy: bool = False
    draining: bool = False
    # Requests this gateway process has running there (their ids).
    requests: set[str] = field(default_factory=set)
    in_flight: int = 0
    # Requests it runs or queues for other gateways, as of its last heartbeat.
    others: int = 0
    # Most requests it runs at once (vLLM's max_num_seqs).
    capacity: int = 0
    # Gateway processes it serves, this one included (its last heartbeat).
    gateways: int = 1
    # Its model's context in tokens (what a request without max_tokens may reach).
    max_model_len: int = 0
    system_fingerprint: str | None = None
    # Its chats stream as under a vLLM tool or reasoning parser (protocol.Heartbeat).
    chat_parser: bool = False
    # Its chats are answered by vLLM's server in the worker (a reasoning parser).
    reasoning_parser: bool = False
    # No longer listed by DNS: closed once idle.
    retired: bool = False
    # Marked down for its silence, with requests waiting for it
    # (--stall-timeout): it may yet speak again.
    stalled: bool = False
    # Requests failed when its connection dropped. The Abort sent for them
    # then went nowhere (a link that is down drops what is sent), so it goes
    # again once the link connects: a worker that lived through the drop (a
    # network blip) would otherwise run them to their end for nobody.
    unsent_aborts: list[str] = field(default_factory=list)
    # Set from the link; plain attributes, not properties: read several times
    # per request. ``key``: stable name for hashing (prefix policy) and metrics.
    address: str = field(init=False)
    key: str = field(init=False)
    in_flight_gauge: Gauge = field(init=False)

    def __post_init__(self) -> None:
        self.address = self.key = self.link.address
        self.in_flight_gauge = metrics.child(metrics.WORKER_IN_FLIGHT, self.key)


class WorkerEvents(Protocol):
    """What the workers tell the one who sends them requests (the pool)."""

    def worker_output(self, link: WorkerLink, message: protocol.ToGateway) -> None:
        """Deltas or a failure, for requests sent over ``link``."""
        ...

    def worker_lost(self, worker: Worker, reason: str, may_return: bool) -> tuple[list[str], int]:
        """``worker`` is out of service: fail its requests (``may_return``: it
        is only silent, so what a retry cannot help may wait for it); the ids
        failed, and how many were kept waiting."""
        ...

    def worker_up(self) -> None:
        """A worker turned healthy: queued requests may find a slot."""
        ...

    def worker_draining(self, worker: Worker) -> None:
        """``worker`` began to drain: what can move on should, not wait for it."""
        ...


class Workers:
    """Every worker address this gateway knows, and each one's health."""

    def __init__(
        self,
        settings: LinkSettings,
        gateway_id: str,
        events: WorkerEvents,
        pool_of_address: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.gateway_id = gateway_id
        self.by_address: dict[str, Worker] = {}
        # Pools of the addresses the config file places (llmgate gateway --config).
        self.pool_of_address: Mapping[str, str] = pool_of_address or {}
        # Every model a worker has said it serves (metrics label only these).
        self.known_models: set[str] = set()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # What each worker's engine holds in its prefix cache, from its KV events.
        self.kv = KvEvents(self.ctx)
        # Per model, its prompts' token ids as its engines see them (asked of
        # the workers that publish KV events: routing by cache needs them).
        # Whether the policy tokenizes prompts (kv): only then are the
        # workers asked for their tokenizers, megabytes each.
        self.wants_tokenizers = False
        self.tokenizers: dict[str, PromptTokenizer] = {}
        # Models that are LoRA adapters -> the name their KV events carry.
        self.adapters: dict[str, str] = {}
        # One tokenizer for the models that share it (a base and its adapters),
        # by a digest of what it is made of (not the megabytes themselves).
        self._loaded: dict[bytes, PromptTokenizer] = {}
        self._described: set[tuple[str, str]] = set()
        self._curve = curve_keys.gateway_curve(settings)  # None: plaintext links
        self._link_events = LinkEvents(self._dispatch, self._on_disconnect, self._on_connect)
        self._events = events
        self._any_healthy = asyncio.Event()

    # -- queries -----------------------------------------------------------

    def healthy(self) -> list[Worker]:
        return [w for w in self.by_address.values() if w.healthy]

    def models(self) -> list[str]:
        return sorted({m for w in self.healthy() for m in w.models})

    @property
    def any_healthy(self) -> bool:
        return self._any_healthy.is_set()

    async def wait_for_any(self) -> bool:
        """Wait up to ``startup_timeout`` for a healthy worker; whether there is one."""
        if not self._any_healthy.is_set():
            try:
                async with asyncio.timeout(self.settings.startup_timeout):
                    await self._any_healthy.wait()
            except TimeoutError:
                return False
        return True

    # -- addresses (from discovery) -----------------------------------------

    def sync(self, addresses: set[str]) -> None:
        """Link to new addresses; retire those no longer listed (closed once idle)."""
        for address in addresses - self.by_address.keys():
            link = WorkerLink(
                self.ctx,
                address,
                self.gateway_id.encode(),
                self._link_events,
                curve=self._curve,
            )
            self.by_address[address] = Worker(link=link)
            link.start()  # it says hello (a ping) once its handshake is done
            log.info("worker address %s added", address)
        for address in self.by_address.keys() - addresses:
            worker = self.by_address[address]
            if not worker.retired:
                log.info("worker address %s no longer resolves: retiring it", address)
                worker.retired = True

    async def close(self) -> None:
        self.kv.close()
        for worker in self.by_address.values():
            if worker.requests:
                worker.link.send(protocol.Abort(request_ids=list(worker.requests)))
            await worker.link.close()
        self.ctx.term()

    # -- what the links say --------------------------------------------------

    def _dispatch(self, link: WorkerLink, message: protocol.ToGateway) -> None:
        if isinstance(message, protocol.Heartbeat):
            worker = self.by_address.get(link.address)
            if worker is not None and worker.link is link:
                self.on_heartbeat(worker, message)
        elif isinstance(message, protocol.Tokenizer):
            self._tokenizer(link.address, message)
        else:
            self._events.worker_output(link, message)

    def on_heartbeat(self, worker: Worker, beat: protocol.Heartbeat) -> None:
        if beat.farewell:
            # Read in order: what it sent before this is read, so it may go.
            worker.link.send(
                protocol.Ping(gateway_id=self.gateway_id, sent_at=time.time(), farewell=True)
            )
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
            if worker.stalled:
                metrics.WORKER_STALLS.labels(worker.key, "lost").inc()
                worker.stalled = False
            self._events.worker_lost(worker, "the worker restarted", False)
        elif worker.stalled:
            log.warning(
                "worker %s speaks again: the requests that waited for it carry on", worker.address
            )
            worker.stalled = False
            metrics.WORKER_STALLS.labels(worker.key, "resumed").inc()
        worker.pool = beat.pool or self.pool_of_address.get(worker.address, "")
        if not worker.healthy:
            log.info(
                "worker %s (%s) is up, serving %s%s",
                worker.address,
                beat.worker_id,
                beat.models,
                f" in pool {worker.pool}" if worker.pool else "",
            )
        began_draining = beat.draining and not worker.draining
        if began_draining:
            log.info("worker %s is draining", worker.address)
        worker.worker_id = beat.worker_id
        worker.incarnation = beat.incarnation
        worker.models = frozenset(beat.models)
        self.known_models.update(beat.models)
        worker.last_heartbeat = time.monotonic()
        was_healthy, worker.healthy = worker.healthy, True
        worker.draining = beat.draining
        worker.system_fingerprint = beat.system_fingerprint or None
        worker.max_model_len = beat.max_model_len
        worker.chat_parser = beat.chat_parser
        worker.reasoning_parser = beat.reasoning_parser
        self.kv.heard(
            worker.address,
            beat.incarnation,
            beat.kv_events_port,
            beat.kv_block_size,
            beat.kv_replay_port,
        )
        if beat.kv_events_port and self.wants_tokenizers:
            self._describe(worker, beat.models)
        # The worker's count includes this gateway's own requests, which
        # in_flight already knows exactly and at once: keep only the rest.
        worker.others = max(0, beat.running + beat.waiting - worker.in_flight)
        worker.capacity = beat.capacity
        worker.gateways = max(1, beat.gateways)
        self._any_healthy.set()
        labels = worker.key
        metrics.WORKER_HEALTHY.labels(labels).set(1)
        metrics.WORKER_RUNNING.labels(labels).set(beat.running)
        metrics.WORKER_WAITING.labels(labels).set(beat.waiting)
        metrics.WORKER_KV_USAGE.labels(labels).set(beat.kv_cache_usage)
        if not was_healthy:
            self._events.worker_up()
        if began_draining:
            self._events.worker_draining(worker)

    def _describe(self, worker: Worker, models: list[str]) -> None:
        """Ask ``worker`` for the tokenizer of each of its models this process lacks (once)."""
        for model in models:
            if model not in self.tokenizers and (worker.address, model) not in self._described:
                self._described.add((worker.address, model))
                worker.link.send(protocol.Describe(model=model))

    def _tokenizer(self, address: str, described: protocol.Tokenizer) -> None:
        if described.model in self.tokenizers:
            return
        source = hashlib.sha256(
            msgspec.msgpack.encode(
                [
                    described.tokenizer_json,
                    described.chat_template,
                    sorted(described.special_tokens.items()),
                ]
            )
        ).digest()
        tokenizer = self._loaded.get(source)
        if tokenizer is None:
            try:
                tokenizer = self._loaded[source] = PromptTokenizer(described)
            except Exception as exc:  # a tokenizer or template this process cannot load
                log.warning(
                    "worker %s's tokenizer for %s does not load here: %s",
                    *(address, described.model, exc),
                )
                return
        if described.lora:
            self.adapters[described.model] = described.lora
        self.tokenizers[described.model] = tokenizer
        log.info("tokenizing %s's prompts as worker %s's engine does", described.model, address)

    def _on_connect(self, link: WorkerLink) -> None:
        # The worker answers a gateway's first message with a heartbeat at once.
        link.send(protocol.Ping(gateway_id=self.gateway_id, sent_at=time.time()))
        worker = self.by_address.get(link.address)
        if worker is not None and worker.link is link and worker.unsent_aborts:
            log.info(
                "worker %s connected again: aborting there the %d requests failed when "
                "its connection dropped",
                worker.address,
                len(worker.unsent_aborts),
            )
            link.send(protocol.Abort(request_ids=worker.unsent_aborts))
            worker.unsent_aborts = []

    def _on_disconnect(self, link: WorkerLink) -> None:
        worker = self.by_address.get(link.address)
        if worker is not None and worker.link is link and (worker.healthy or worker.stalled):
            failed = self.lose(worker, "its connection dropped")
            worker.unsent_aborts.extend(failed)

    # -- liveness ----------------------------------------------------------

    def lose(self, worker: Worker, reason: str, silent: bool = False) -> list[str]:
        """Take ``worker`` out of service and fail its requests; the ids failed.

        ``silent``: it is only silent, and may be stalled rather than gone:
        its requests that cannot go elsewhere wait for it (``--stall-timeout``).
        """
        if worker.healthy:
            log.warning("worker %s lost: %s", worker.address, reason)
        elif worker.stalled:
            log.warning(
                "worker %s: the requests that waited for it end (%s)", worker.address, reason
            )
            metrics.WORKER_STALLS.labels(worker.key, "lost").inc()
        worker.healthy = False
        metrics.WORKER_HEALTHY.labels(worker.key).set(0)
        if not silent:
            # Its connection dropped: its process (and its cache) likely went.
            self.kv.forget(worker.address)
        may_return = silent and self.settings.stall_timeout > self.settings.heartbeat_timeout
        failed, kept = self._events.worker_lost(
            worker, f"the worker was lost: {reason}", may_return
        )
        if failed:
            # A hung worker (stopped, overloaded, partitioned) may come back:
            # it must then drop what it ran for us, which went elsewhere or
            # ended in an error. A crashed one never reads this.
            worker.link.send(protocol.Abort(request_ids=failed))
        worker.stalled = kept > 0
        if kept:
            log.warning(
                "worker %s: %d requests there wait for it (streams under way, or with "
                "no other worker to take them), up to --stall-timeout %gs",
                worker.address,
                kept,
                self.settings.stall_timeout,
            )
        if not self.healthy():
            self._any_healthy.clear()
        return failed

    async def monitor(self) -> None:
        """Ping every worker each heartbeat interval; lose silent ones, drop idle retired ones."""
        interval = self.settings.heartbeat_interval
        ticks = Ticks(interval, "gateway", "workers' silence")
        while True:
            await asyncio.sleep(interval)
            ping = protocol.Ping(gateway_id=self.gateway_id, sent_at=time.time())
            for worker in self.by_address.values():
                worker.link.send(ping)
            now = time.monotonic()
            # Woken far later than asked: this process was stalled, not the
            # workers silent. What they sent meanwhile may still be in the
            # kernel's buffers: judge silence on a later tick (the workers do
            # the same about their gateways).
            late = ticks.late()
            for worker in list(self.by_address.values()):
                if (worker.healthy or worker.stalled) and not late:
                    # Timers run before I/O in a loop turn: read what waits first.
                    worker.link.read_ready()
                    heard = max(worker.last_heartbeat, worker.link.last_received)
                    silent = now - heard
                    if worker.healthy and silent > self.settings.heartbeat_timeout:
                        self.lose(worker, f"silent for {silent:.1f}s", silent=True)
                    elif worker.stalled and silent > self.settings.stall_timeout:
                        self.lose(worker, f"silent for {silent:.1f}s")
                if worker.retired and not worker.requests:
                    await self._remove(worker)

    async def _remove(self, worker: Worker) -> None:
        del self.by_address[worker.address]
        self.kv.forget(worker.address)
        metrics.WORKER_HEALTHY.labels(worker.key).set(0)
        await worker.link.close()
        if not self.healthy():
            self._any_healthy.clear()
