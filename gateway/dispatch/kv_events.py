"""Every worker's KV cache events, read into this process's index (``gateway.dispatch.kv_index``).

A worker whose engine publishes KV cache events (vLLM's ``--kv-events-config``
with the ZeroMQ publisher) says on which port in its heartbeats; this
process subscribes to it on the worker's host, so every gateway process
reads the same events and keeps the same index, with no shared store. A
worker that restarts (a new incarnation), stops publishing or leaves is
dropped from the index at once, and its new events are read from then on.
Batches missed (a sequence gap: a late start, a full queue) are counted in
``llmgate_kv_events_gaps_total``; what they said is not recovered yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import zmq

from gateway import metrics
from gateway.dispatch.kv_index import KvIndex, decode_batch
from shared.zmqio import Reader

log = logging.getLogger(__name__)


@dataclass
class _Subscription:
    incarnation: str
    port: int
    block_size: int
    sock: zmq.Socket[bytes]
    reader: Reader[list[bytes]]
    last_seq: int = -1


class KvEvents:
    """The subscriptions to the workers' KV cache events, and the index they feed."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.ctx = ctx
        self.index = KvIndex()
        self._subscriptions: dict[str, _Subscription] = {}

    def block_size(self, address: str) -> int:
        """The tokens of one cache block of the worker at ``address`` (0: no events from it)."""
        sub = self._subscriptions.get(address)
        return sub.block_size if sub is not None else 0

    def heard(self, address: str, incarnation: str, port: int, block_size: int) -> None:
        """A heartbeat of the worker at ``address``: subscribe, or start again if it restarted."""
        sub = self._subscriptions.get(address)
        if sub is not None and (sub.incarnation, sub.port) == (incarnation, port):
            return
        if sub is not None:
            self.forget(address)  # restarted, or moved: what it held is gone
        if not port or not block_size:
            return
        host = address.removeprefix("tcp://").rsplit(":", 1)[0]
        endpoint = f"tcp://{host}:{port}"
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        reader: Reader[list[bytes]] = Reader(
            sock, lambda frames: self._batch(address, frames), multipart=True
        )
        self._subscriptions[address] = _Subscription(incarnation, port, block_size, sock, reader)
        reader.start()
        log.info("reading worker %s's KV cache events at %s", address, endpoint)

    def forget(self, address: str) -> None:
        """The worker at ``address`` left (or restarted): nothing of it stays in the index."""
        sub = self._subscriptions.pop(address, None)
        if sub is None:
            return  # it never published: nothing of it is indexed
        sub.reader.stop()
        sub.sock.close(linger=0)
        self.index.drop(address)
        metrics.KV_INDEX_BLOCKS.labels(address).set(0)

    def close(self) -> None:
        for address in list(self._subscriptions):
            self.forget(address)

    def _batch(self, address: str, frames: list[bytes]) -> None:
        sub = self._subscriptions.get(address)
        if sub is None or len(frames) != 3:
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if sub.last_seq >= 0 and seq != sub.last_seq + 1:
            metrics.KV_EVENTS_GAPS.labels(address).inc()
            log.warning(
                "worker %s's KV cache events: batches %d to %d missed",
                address,
                sub.last_seq + 1,
                seq - 1,
            )
        sub.last_seq = seq
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            log.warning("worker %s sent an unreadable KV event batch: %s", address, exc)
            return
        self.index.apply(address, batch)
        metrics.KV_INDEX_BLOCKS.labels(address).set(self.index.blocks_of(address))
