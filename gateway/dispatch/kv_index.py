"""Which worker's engine holds which prompt blocks: an index fed by vLLM's own KV events.

Each worker's engine publishes a batch of events whenever its prefix cache
changes (vLLM's ``--kv-events-config``): ``BlockStored`` (the blocks' vLLM
hashes, their parent's, and their token ids), ``BlockRemoved`` (hashes),
``AllBlocksCleared``. vLLM's hashes come from a seeded function the gateway
cannot reproduce, so the index keys a block by its content: a chain of
hashes over the token ids of each full block and of every block before it
(and the LoRA adapter), the same in every gateway process that reads the
same events. ``match`` walks a prompt's blocks and says, per worker, how
many leading blocks its engine holds. A worker that restarts, clears its
cache or leaves is ``drop``-ped; an event whose parent the index never saw
(events missed) is counted in ``orphans``, and its blocks are not indexed.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import msgspec

# -- vLLM's wire format (vllm.distributed.kv_events), without importing vLLM --

BlockHash = int | bytes


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """vLLM's ``KVEventBatch``: one ZeroMQ message's payload (msgpack)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


decode_batch = msgspec.msgpack.Decoder(EventBatch).decode


def root(lora: str | None = None) -> int:
    """The chain's start for a prompt run with ``lora`` (an adapter's name; None: the base
    model): blocks of different adapters never share a key. crc32, not ``hash``: a
    string's ``hash`` differs between processes."""
    return zlib.crc32(lora.encode()) if lora else 0


def block_keys(tokens: Sequence[int], block_size: int, lora: str | None = None) -> list[int]:
    """The keys of the full blocks of ``tokens``, in order: each hashes the block's
    token ids and the key before it (ints and tuples of ints hash alike in every
    process)."""
    key = root(lora)
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = hash((key, *tokens[start : start + block_size]))
        keys.append(key)
    return keys


class _Worker:
    __slots__ = ("bit", "known")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        # vLLM's hash of each block its engine holds -> the index's key.
        self.known: dict[BlockHash, int] = {}


class KvIndex:
    """Every worker's cached blocks, by content; one per gateway process."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        # A block's key -> the workers holding it, one bit each.
        self._holders: dict[int, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1
        # Blocks stored under a parent the index never saw (events missed).
        self.orphans = 0

    def __len__(self) -> int:
        """Blocks indexed: distinct keys held by any worker."""
        return len(self._holders)

    def blocks_of(self, worker: str) -> int:
        entry = self._workers.get(worker)
        return len(entry.known) if entry is not None else 0

    def _worker(self, address: str) -> _Worker:
        entry = self._workers.get(address)
        if entry is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = self._next_bit, self._next_bit << 1
            entry = self._workers[address] = _Worker(bit)
        return entry

    def apply(self, worker: str, batch: EventBatch) -> None:
        """The events of one batch from ``worker``'s engine, in order."""
        entry = self._worker(worker)
        for event in batch.events:
            if type(event) is BlockStored:
                self._stored(entry, event)
            elif type(event) is BlockRemoved:
                self._removed(entry, event.block_hashes)
            else:
                self._clear(entry)

    def _stored(self, entry: _Worker, event: BlockStored) -> None:
        parent = event.parent_block_hash
        if parent is None:
            key = root(event.lora_name)
        else:
            found = entry.known.get(parent)
            if found is None:
                self.orphans += len(event.block_hashes)
                return
            key = found
        holders, known, bit, size = self._holders, entry.known, entry.bit, event.block_size
        tokens = event.token_ids
        for i, block_hash in enumerate(event.block_hashes):
            key = hash((key, *tokens[i * size : (i + 1) * size]))
            known[block_hash] = key
            holders[key] = holders.get(key, 0) | bit

    def _removed(self, entry: _Worker, hashes: list[BlockHash]) -> None:
        holders, known, keep = self._holders, entry.known, ~entry.bit
        for block_hash in hashes:
            key = known.pop(block_hash, None)
            if key is None:
                continue
            left = holders.get(key, 0) & keep
            if left:
                holders[key] = left
            else:
                holders.pop(key, None)

    def _clear(self, entry: _Worker) -> None:
        self._removed(entry, list(entry.known))

    def drop(self, worker: str) -> None:
        """``worker`` restarted, cleared its cache or left: it holds nothing."""
        entry = self._workers.pop(worker, None)
        if entry is not None:
            self._clear(entry)
            self._free_bits.append(entry.bit)

    def match(self, keys: Sequence[int]) -> dict[str, int]:
        """Per worker holding the first of ``keys`` (``block_keys`` of a prompt), how
        many leading blocks of the prompt its engine holds."""
        holders = self._holders
        alive = holders.get(keys[0], 0) if keys else 0
        if not alive:
            return {}
        depth_of: dict[int, int] = {}
        depth = 1
        for key in keys[1:]:
            still = holders.get(key, 0) & alive
            gone = alive & ~still
            if gone:
                depth_of[gone] = depth
            alive = still
            if not alive:
                break
            depth += 1
        if alive:
            depth_of[alive] = depth
        matched = {}
        for address, entry in self._workers.items():
            for bits, blocks in depth_of.items():
                if bits & entry.bit:
                    matched[address] = blocks
                    break
        return matched
