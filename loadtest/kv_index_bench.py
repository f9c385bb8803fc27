"""What the KV index costs one gateway process (``gateway.dispatch.kv_index``), measured.

    .venv/bin/python -m loadtest.kv_index_bench [--workers 32] [--blocks 1000000]

Three figures, in this process, no network:

* **absorbed**: block events (stored and removed blocks) per second that
  decoding and applying vLLM's msgpack batches takes, from ``--workers``
  simulated engines each filling a cache of ``--cache-blocks`` blocks of
  ``--block-size`` tokens with conversations that share a system prompt,
  evicting least recently used blocks once full (the batches are encoded
  before the clock starts, as the ZeroMQ socket hands them over);
* **memory**: bytes the index holds per block indexed, at ``--blocks``
  blocks over the workers (``tracemalloc``);
* **match**: the routing lookup for a ``--prompt-tokens`` (2,000) prompt,
  its block keys and the walk over the index, p50 and p99;
* **decision**: the kv policy's whole choice (``gateway.dispatch.policies.kv_cache``)
  for a chat of about ``--prompt-tokens`` tokens, a document and a question,
  over ``--workers`` workers each holding part of the document: rendering with
  the embedded model's chat template, tokenizing as the gateway does, block
  keys, the index walk, the choice; p50 and p99 with the document seen before
  (a new question each time) and with a new document each time, when the
  model is converted.

Writes ``summary.json`` under ``loadtest/results/<time>-kv-index/``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import random
import statistics
import time
import tracemalloc
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import msgspec

from gateway.dispatch.kv_index import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvIndex,
    block_keys,
    decode_batch,
)
from loadtest.report import results_dir, write_json


class _Engine:
    """One simulated engine's prefix cache: which blocks it holds, least recent first."""

    def __init__(self, cache_blocks: int, block_size: int, rng: random.Random) -> None:
        self.cache_blocks = cache_blocks
        self.block_size = block_size
        self.rng = rng
        self.held: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.next_hash = rng.randrange(1 << 60)

    def request(self, system: list[int], turns: int) -> list[bytes]:
        """One conversation's prompt stored (the system prompt's blocks shared), as
        the batches its engine would publish: the new blocks, and what they evicted."""
        encode = msgspec.msgpack.Encoder().encode
        size = self.block_size
        tokens = system + [self.rng.randrange(50_000) for _ in range(turns * size)]
        batches = []
        parent: int | None = None
        hashes = []
        for start in range(0, len(tokens) - size + 1, size):
            # Equal content hashes alike in vLLM too: a shared prefix is one block.
            block_hash = hash((parent, *tokens[start : start + size])) & ((1 << 63) - 1)
            hashes.append((block_hash, parent, tokens[start : start + size]))
            parent = block_hash
        events: list[Any] = []
        for block_hash, parent_hash, block in hashes:
            if block_hash in self.held:
                self.held.move_to_end(block_hash)
                continue
            events.append(BlockStored([block_hash], parent_hash, block, size))
            self.held[block_hash] = None
        evicted = []
        while len(self.held) > self.cache_blocks:
            evicted.append(self.held.popitem(last=False)[0])
        if evicted:
            events.append(BlockRemoved(evicted))
        if events:
            batches.append(encode(EventBatch(time.time(), events)))
        return batches


def _events(args: argparse.Namespace) -> tuple[list[tuple[str, bytes]], int]:
    """Every engine's batches, interleaved, and the block events they hold."""
    rng = random.Random(7)
    systems = [[rng.randrange(50_000) for _ in range(args.block_size * 8)] for _ in range(16)]
    engines = {
        f"tcp://10.0.0.{i}:5557": _Engine(args.cache_blocks, args.block_size, rng)
        for i in range(args.workers)
    }
    out: list[tuple[str, bytes]] = []
    block_events = 0
    while block_events < args.events:
        for address, engine in engines.items():
            for payload in engine.request(rng.choice(systems), rng.randrange(1, 12)):
                out.append((address, payload))
                for event in decode_batch(payload).events:
                    if isinstance(event, BlockStored | BlockRemoved):
                        block_events += len(event.block_hashes)
    return out, block_events


def absorbed(args: argparse.Namespace) -> dict[str, float]:
    batches, block_events = _events(args)
    index = KvIndex()
    gc.collect()
    started = time.perf_counter()
    for address, payload in batches:
        index.apply(address, decode_batch(payload))
    seconds = time.perf_counter() - started
    return {
        "batches": len(batches),
        "block_events": block_events,
        "seconds": round(seconds, 3),
        "block_events_per_s": round(block_events / seconds),
        "blocks_indexed_at_end": len(index),
    }


def memory(args: argparse.Namespace) -> dict[str, float]:
    """Bytes per block, with ``--blocks`` distinct blocks spread over the workers."""
    rng = random.Random(11)
    per_worker = args.blocks // args.workers
    batches = []
    for w in range(args.workers):
        tokens = [rng.randrange(50_000) for _ in range(per_worker * args.block_size)]
        hashes = list(range(w * per_worker + 1, (w + 1) * per_worker + 1))
        event = BlockStored(hashes, None, tokens, args.block_size)
        # One chain per worker: each block's parent is the one before.
        batches.append((f"w{w}", EventBatch(0.0, [event])))
    gc.collect()
    tracemalloc.start()
    index = KvIndex()
    for address, batch in batches:
        index.apply(address, batch)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "blocks": len(index),
        "bytes": size,
        "bytes_per_block": round(size / max(1, len(index)), 1),
        "mib_per_million_blocks": round(size / max(1, len(index)) * 1e6 / 2**20, 1),
    }


def match(args: argparse.Namespace) -> dict[str, float]:
    """The lookup for one long prompt against an index of ``--workers`` engines,
    each holding a different share of its leading blocks."""
    rng = random.Random(13)
    size = args.block_size
    prompt = [rng.randrange(50_000) for _ in range(args.prompt_tokens)]
    index = KvIndex()
    blocks = len(prompt) // size
    for w in range(args.workers):
        held = rng.randrange(blocks + 1)
        if held:
            hashes = list(range(w * 10_000 + 1, w * 10_000 + held + 1))
            event = BlockStored(hashes, None, prompt[: held * size], size)
            index.apply(f"w{w}", EventBatch(0.0, [event]))
    times = []
    for _ in range(args.match_runs):
        started = time.perf_counter_ns()
        index.match(block_keys(prompt, size))
        times.append((time.perf_counter_ns() - started) / 1000)
    times.sort()
    return {
        "prompt_tokens": len(prompt),
        "blocks": blocks,
        "p50_us": round(statistics.median(times), 1),
        "p99_us": round(times[int(len(times) * 0.99) - 1], 1),
    }


def _prompt_tokenizer() -> Any:
    """The embedded model's tokenizer as the gateway builds it (None: not converted)."""
    from gateway.dispatch.tokens import PromptTokenizer
    from loadtest.sim_engine import described_tokenizer
    from shared.embedded import default_model_dir

    if not (default_model_dir() / "tokenizer.json").is_file():
        return None
    return PromptTokenizer(described_tokenizer())


def decision(args: argparse.Namespace) -> dict[str, Any] | None:
    """The kv policy's whole choice for a chat of about ``--prompt-tokens`` tokens (a
    document and a question) over ``--workers`` workers, each holding a different
    share of the document: rendering, tokenizing, block keys, the index walk and
    the choice. ``warm``: the document seen before, a new question each time (its
    pieces' ids kept); ``cold``: a new document each time."""
    from gateway.dispatch.policies import RoutingContext
    from gateway.dispatch.policies.kv_cache import CacheAware
    from gateway.dispatch.policies.prefix import PrefixAffinity
    from gateway.dispatch.work import WorkOrder
    from gateway.dispatch.workers import Worker

    tokenizer = _prompt_tokenizer()
    if tokenizer is None:
        return None
    rng = random.Random(17)
    words = ["lighthouse", "keeper", "ship", "storm", "harbour", "night", "lamp", "sea"]

    def chat(document: str, question: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": f"Answer from this document.\n{document}"},
            {"role": "user", "content": question},
        ]

    def document() -> str:
        return " ".join(rng.choice(words) for _ in range(args.prompt_tokens))

    size = args.block_size
    index = KvIndex()
    workers = [
        Worker(link=SimpleNamespace(address=f"tcp://10.0.{w // 250}.{w % 250}:5550"))  # type: ignore[arg-type]
        for w in range(args.workers)
    ]
    kv = SimpleNamespace(index=index, block_size=lambda address: size)
    policy = CacheAware(
        SimpleNamespace(kv=kv, tokenizers={"m": tokenizer}, adapters={}),  # type: ignore[arg-type]
        PrefixAffinity(),
    )
    shared = document()
    tokens = list(tokenizer.chat_ids(chat(shared, "Who kept the lamp?"))[0])
    blocks = len(tokens) // size
    for n, worker in enumerate(workers):
        held = rng.randrange(blocks + 1)
        if held:
            hashes = list(range(n * 100_000 + 1, n * 100_000 + held + 1))
            event = BlockStored(hashes, None, tokens[: held * size], size)
            index.apply(worker.address, EventBatch(0.0, [event]))

    def timed(messages: list[list[dict[str, str]]]) -> dict[str, float]:
        times = []
        for i, conversation in enumerate(messages):
            order = WorkOrder(f"r{i}", "chat", "m", {"messages": conversation})
            context = RoutingContext(workers, None, "m", order)
            started = time.perf_counter_ns()
            policy.select(context)
            times.append((time.perf_counter_ns() - started) / 1000)
        times.sort()
        return {
            "runs": len(times),
            "p50_us": round(statistics.median(times), 1),
            "p99_us": round(times[max(0, int(len(times) * 0.99) - 1)], 1),
        }

    runs = max(20, args.match_runs // 4)
    cold = timed([chat(document(), "Who kept the lamp?") for _ in range(max(10, runs // 10))])
    warm = timed([chat(shared, f"Question {i}: who kept the lamp?") for i in range(runs)])
    return {"prompt_tokens": len(tokens), "warm": warm, "cold": cold}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-blocks", type=int, default=4096, help="per simulated engine")
    parser.add_argument("--events", type=int, default=1_000_000, help="block events absorbed")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks for the memory")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--match-runs", type=int, default=2000)
    args = parser.parse_args(argv)
    started = datetime.now(UTC)
    report = {
        "date": started.isoformat(),
        "workers": args.workers,
        "block_size": args.block_size,
        "absorbed": absorbed(args),
        "memory": memory(args),
        "match": match(args),
        "decision": decision(args),
    }
    out = results_dir("kv-index", started)
    write_json(out / "summary.json", report)
    a, m, k = report["absorbed"], report["memory"], report["match"]
    print(
        f"absorbed: {a['block_events_per_s']:,} block events/s "
        f"({a['block_events']:,} in {a['seconds']} s, {a['batches']:,} batches)\n"
        f"memory: {m['bytes_per_block']} bytes per block "
        f"({m['mib_per_million_blocks']} MiB per million; {m['blocks']:,} blocks)\n"
        f"match, {k['prompt_tokens']}-token prompt ({k['blocks']} blocks) over "
        f"{args.workers} workers: p50 {k['p50_us']} us, p99 {k['p99_us']} us\n"
        f"written to {out}"
    )
    d = report["decision"]
    if d is not None:
        w, c = d["warm"], d["cold"]
        print(
            f"kv routing decision, a {d['prompt_tokens']}-token chat over {args.workers} "
            f"workers: document seen p50 {w['p50_us']} us, p99 {w['p99_us']} us; "
            f"new document p50 {c['p50_us']} us, p99 {c['p99_us']} us"
        )


if __name__ == "__main__":
    main()
