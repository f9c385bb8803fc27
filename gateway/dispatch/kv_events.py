"""Every worker's KV cache events, read into this process's index (``gateway.dispatch.kv_index``).

A worker whose engine publishes KV cache events (vLLM's ``--kv-events-config``
with the ZeroMQ publisher) says on which port in its heartbeats; this
process subscribes to it on the worker's host, so every gateway process
reads the same events and keeps the same index, with no shared store. A
worker that restarts (a new incarnation), stops publishing or leaves is
dropped from the index at once, and its new events are read from then on.

Batches missed (a sequence gap: a process that subscribed late, a full
queue) are counted in ``llmgate_kv_events_gaps_total`` and asked again of
the publisher's replay endpoint (vLLM's ``replay_endpoint``, which keeps its
last ``buffer_steps`` batches) when the worker names one: live batches are
held meanwhile, then the replayed ones and the held ones are applied in
sequence order, each once. What the replay no longer holds (or a worker
without a replay endpoint) stays missed: its blocks are not indexed, and
blocks stored under them are counted as orphans.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import msgspec
import zmq

from gateway import metrics
from gateway.dispatch.kv_index import KvIndex, decode_batch
from shared.zmqio import Reader

log = logging.getLogger(__name__)

# vLLM's end of a replay (``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Seconds a replay may take before the batches held for it are applied without it.
REPLAY_TIMEOUT = 5.0


@dataclass
class _Replay:
    """Missed batches asked of a publisher's replay endpoint, and live ones held meanwhile."""

    sock: zmq.Socket[bytes]
    reader: Reader[list[bytes]]
    timer: asyncio.TimerHandle
    batches: dict[int, bytes] = field(default_factory=dict)

    def close(self) -> None:
        self.timer.cancel()
        self.reader.stop()
        self.sock.close(linger=0)


@dataclass
class _Subscription:
    incarnation: str
    port: int
    block_size: int
    sock: zmq.Socket[bytes]
    reader: Reader[list[bytes]]
    host: str
    replay_port: int = 0
    # The last batch applied; -1: none yet (vLLM numbers a publisher's from 0).
    last_seq: int = -1
    replay: _Replay | None = None


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

    def heard(
        self, address: str, incarnation: str, port: int, block_size: int, replay_port: int = 0
    ) -> None:
        """A heartbeat of the worker at ``address``: subscribe, or start again if it restarted."""
        sub = self._subscriptions.get(address)
        if sub is not None and (sub.incarnation, sub.port) == (incarnation, port):
            sub.replay_port = replay_port
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
            sock, lambda frames: self._live(address, frames), multipart=True
        )
        self._subscriptions[address] = _Subscription(
            incarnation, port, block_size, sock, reader, host, replay_port
        )
        reader.start()
        log.info("reading worker %s's KV cache events at %s", address, endpoint)

    def forget(self, address: str) -> None:
        """The worker at ``address`` left (or restarted): nothing of it stays in the index."""
        sub = self._subscriptions.pop(address, None)
        if sub is None:
            return  # it never published: nothing of it is indexed
        if sub.replay is not None:
            sub.replay.close()
        sub.reader.stop()
        sub.sock.close(linger=0)
        self.index.drop(address)
        metrics.KV_INDEX_BLOCKS.labels(address).set(0)

    def close(self) -> None:
        for address in list(self._subscriptions):
            self.forget(address)

    def _live(self, address: str, frames: list[bytes]) -> None:
        sub = self._subscriptions.get(address)
        if sub is None or len(frames) != 3:
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if sub.replay is not None:
            sub.replay.batches[seq] = payload  # applied in order once the replay ends
            return
        if seq <= sub.last_seq:
            return  # already applied (replayed)
        if seq != sub.last_seq + 1:
            metrics.KV_EVENTS_GAPS.labels(address).inc()
            if sub.replay_port:
                log.info(
                    "worker %s's KV cache events: batches %d to %d missed, asking its replay",
                    address,
                    sub.last_seq + 1,
                    seq - 1,
                )
                self._ask_replay(address, sub).batches[seq] = payload
                return
            log.warning(
                "worker %s's KV cache events: batches %d to %d missed",
                address,
                sub.last_seq + 1,
                seq - 1,
            )
        self._apply(address, sub, seq, payload)

    def _apply(self, address: str, sub: _Subscription, seq: int, payload: bytes) -> None:
        sub.last_seq = seq
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            log.warning("worker %s sent an unreadable KV event batch: %s", address, exc)
            return
        self.index.apply(address, batch)
        metrics.KV_INDEX_BLOCKS.labels(address).set(self.index.blocks_of(address))

    def _ask_replay(self, address: str, sub: _Subscription) -> _Replay:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{sub.host}:{sub.replay_port}")
        reader: Reader[list[bytes]] = Reader(
            sock, lambda frames: self._replayed(address, sock, frames), multipart=True
        )
        timer = asyncio.get_running_loop().call_later(
            REPLAY_TIMEOUT, self._end_replay, address, sock, True
        )
        sub.replay = _Replay(sock, reader, timer)
        # vLLM's replay request: an empty delimiter, then the first sequence number wanted.
        sock.send_multipart([b"", (sub.last_seq + 1).to_bytes(8, "big")])
        reader.start()
        return sub.replay

    def _replayed(self, address: str, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        sub = self._subscriptions.get(address)
        if sub is None or sub.replay is None or sub.replay.sock is not sock:
            return  # a replay given up on
        if len(frames) != 4:
            return
        _, _, seq_bytes, payload = frames
        if seq_bytes == END_SEQ:
            self._end_replay(address, sock, False)
            return
        sub.replay.batches.setdefault(int.from_bytes(seq_bytes, "big"), payload)

    def _end_replay(self, address: str, sock: zmq.Socket[bytes], timed_out: bool) -> None:
        """Apply what the replay and the live feed gave, in sequence order, each once."""
        sub = self._subscriptions.get(address)
        if sub is None or sub.replay is None or sub.replay.sock is not sock:
            return
        replay, sub.replay = sub.replay, None
        replay.close()
        if timed_out:
            log.warning("worker %s's KV cache events: its replay did not answer", address)
        for seq in sorted(replay.batches):
            if seq <= sub.last_seq:
                continue
            if seq != sub.last_seq + 1:
                log.warning(
                    "worker %s's KV cache events: batches %d to %d lost (not in its replay)",
                    address,
                    sub.last_seq + 1,
                    seq - 1,
                )
            self._apply(address, sub, seq, replay.batches[seq])
