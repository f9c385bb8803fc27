"""A SIMULATED engine with a paged prefix cache: a benchmark double for routing. Not a model.

Where ``loadtest.fake_engine`` measures the gateway's own cost, this double
models what routing changes: an engine's prefix cache. It tokenizes a prompt
as the embedded model's engine would (the gateway's ``PromptTokenizer``,
over the converted model's tokenizer and chat template, which it also hands
to a gateway that asks), cuts it into ``block_size``-token blocks, and finds
the leading blocks its cache holds. The model:

* **cache**: ``cache_blocks`` blocks, least recently used evicted first; a
  prompt's full blocks are stored once computed;
* **prefill**: ``prefill_s_per_token`` seconds per uncached prompt token, one
  prefill at a time per engine (as a GPU runs one forward at a time);
* **decode**: ``max_tokens`` steps of ``step_s + step_s_per_seq`` x running
  sequences each, so a batch slows each of its requests;
* **events**: every store and eviction is published as vLLM publishes its KV
  cache events (``--kv-events-config``: ZeroMQ PUB frames of topic, sequence
  number, msgpack ``EventBatch``), so a gateway indexes this engine as it
  indexes vLLM.

Each engine counts the prompt tokens it was sent and those its cache held;
:class:`Fleet` (``python -m loadtest.sim_engine``) runs many in one process,
behind the real worker loop each, and also counts the floor: the tokens an
infinite cache shared by all of them would still compute.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import signal
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import zmq

from gateway.dispatch.kv_index import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    block_keys,
)
from gateway.dispatch.policies.kv_cache import prompt_tokens
from gateway.dispatch.tokens import PromptTokenizer
from shared import protocol, settings
from shared.logs import setup_logging
from worker.errors import RequestError
from worker.prepare import PreparedPrompt

log = logging.getLogger(__name__)

TOKEN_TEXT = " sim"
# The id its tokens go out under (a stream that moves carries them).
TOKEN_ID = 1
_encode = msgspec.msgpack.Encoder().encode


@dataclass(frozen=True)
class CacheModel:
    """What one simulated engine is like (a model, not a measurement)."""

    block_size: int = 16
    cache_blocks: int = 2048
    prefill_s_per_token: float = 0.00002
    step_s: float = 0.01
    step_s_per_seq: float = 0.0002
    capacity: int = 64


@dataclass
class Counts:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Most requests it held at once, and the sum of what each arrival found.
    peak_running: int = 0
    running_at_arrival: int = 0
    # Seconds its requests were held, summed (queued for the prefill, prefilling
    # and decoding): its load over a run, where a count of requests weighs a
    # request that queued behind others' prefills as one that did not.
    held_seconds: float = 0.0


def described_tokenizer() -> protocol.Tokenizer:
    """The embedded model's tokenizer and chat template, as a worker describes them."""
    from shared.embedded import default_model_dir

    directory = default_model_dir()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    template_file = directory / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config["chat_template"]
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    return protocol.Tokenizer(
        settings.DEFAULT_MODEL_NAME, (directory / "tokenizer.json").read_text(), template, special
    )


@dataclass(frozen=True)
class SimParams:
    tokens: Sequence[int]
    max_tokens: int


@dataclass
class Floor:
    """The blocks an infinite cache shared by every engine would hold: what no routing
    can avoid computing."""

    seen: set[int] = field(default_factory=set)
    tokens: int = 0

    def add(self, keys: list[int], prompt_tokens: int, block_size: int) -> None:
        new = [k for k in keys if k not in self.seen]
        self.seen.update(new)
        self.tokens += len(new) * block_size + (prompt_tokens - len(keys) * block_size)


class SimEngine:
    """One simulated engine: a ``worker.engine_api.ModelEngine`` over a modelled cache."""

    system_fingerprint = ""
    chat_parser = False
    reasoning_parser = False
    kv_replay_port = 0

    def __init__(
        self,
        model: CacheModel,
        tokenizer: PromptTokenizer,
        described: protocol.Tokenizer,
        ctx: zmq.Context[zmq.Socket[bytes]],
        events_port: int,
        floor: Floor,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.described = described
        self.served_model_names = [described.model]
        self.max_num_seqs = model.capacity
        self.max_model_len = 1 << 20
        self.kv_events_port = events_port
        self.kv_block_size = model.block_size
        self.loras: dict[str, Any] = {}
        self.floor = floor
        self.counts = Counts()
        self.running = 0
        # Block key -> the hash it was published under, least recently used first.
        self._cache: OrderedDict[int, int] = OrderedDict()
        self._hashes = itertools.count(1)
        self._prefill = asyncio.Lock()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(f"tcp://127.0.0.1:{events_port}")
        self._seq = 0

    # -- ModelEngine -------------------------------------------------------

    async def start(self) -> None:
        return None

    def describe_tokenizer(self) -> tuple[str, str, dict[str, str]] | None:
        d = self.described
        return d.tokenizer_json, d.chat_template, dict(d.special_tokens)

    def engine_priority(self, priority: int) -> int:
        return 0

    def passthrough(
        self, request_id: str, params: dict[str, Any], model: str = "", priority: int = 0
    ) -> AsyncIterator[list[protocol.Delta]]:
        raise RequestError(503, "the SIMULATED engine has no vLLM server")

    async def prepare(
        self,
        kind: protocol.RequestKind,
        params: dict[str, Any],
        continuation: protocol.Continuation | None = None,
    ) -> list[PreparedPrompt]:
        read = prompt_tokens(self.tokenizer, kind, params)
        if read is None:
            raise RequestError(400, "the SIMULATED engine reads chats and text prompts only")
        tokens = read[0]
        max_tokens = int(params.get("max_tokens") or params.get("max_completion_tokens") or 16)
        carried = 0
        if continuation is not None:
            # Moved from an engine that restarted: its tokens end the prompt.
            carried = len(continuation.token_ids)
            tokens = [*tokens, *continuation.token_ids]
            max_tokens -= carried
            if max_tokens <= 0:
                raise RequestError(400, "The continued answer has no tokens left to generate.")
        return [PreparedPrompt(None, SimParams(tokens, max_tokens), len(tokens), carried=carried)]

    async def run(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        trace: dict[str, str] | None = None,
        model: str = "",
        priority: int = 0,
    ) -> AsyncIterator[list[protocol.Delta]]:
        sim: SimParams = prompts[0].sampling_params
        counts = self.counts
        counts.requests += 1
        counts.running_at_arrival += self.running
        self.running += 1
        counts.peak_running = max(counts.peak_running, self.running)
        arrived = time.monotonic()
        try:
            size = self.model.block_size
            keys = block_keys(sim.tokens, size)
            if not prompts[0].carried:
                # (A moved request's prompt was counted where it began.)
                self.floor.add(keys, len(sim.tokens), size)
            async with self._prefill:
                held = self._held(keys)
                counts.prompt_tokens += len(sim.tokens)
                counts.cached_tokens += held * size
                uncached = len(sim.tokens) - held * size
                await asyncio.sleep(uncached * self.model.prefill_s_per_token)
                self._store(keys, sim.tokens)
            for step in range(sim.max_tokens):
                if step:
                    step_s = self.model.step_s + self.model.step_s_per_seq * self.running
                    await asyncio.sleep(step_s)
                last = step == sim.max_tokens - 1
                yield [
                    protocol.Delta(
                        request_id=request_id,
                        index=0,
                        text=TOKEN_TEXT,
                        num_tokens=1,
                        finish_reason="length" if last else None,
                        token_ids=[TOKEN_ID],
                    )
                ]
        finally:
            self.running -= 1
            counts.held_seconds += time.monotonic() - arrived
        carried = prompts[0].carried
        usage = protocol.Usage(len(sim.tokens) - carried, sim.max_tokens + carried)
        yield [protocol.Delta(request_id=request_id, index=0, usage=usage)]

    def load(self) -> tuple[int, int, float]:
        return self.running, 0, len(self._cache) / self.model.cache_blocks

    def shutdown(self) -> None:
        self._pub.close(linger=0)

    # -- the cache ---------------------------------------------------------

    def _held(self, keys: list[int]) -> int:
        """Leading blocks of ``keys`` the cache holds."""
        held = 0
        for key in keys:
            if key not in self._cache:
                break
            held += 1
        return held

    def _store(self, keys: list[int], tokens: Sequence[int]) -> None:
        size = self.model.block_size
        events: list[Any] = []
        parent: int | None = None
        run_start = 0
        run_hashes: list[BlockHash] = []
        for i, key in enumerate(keys):
            if key in self._cache:
                if run_hashes:
                    break  # stored before: a cached block after a new one cannot be
                parent = self._cache[key]
                run_start = i + 1
                continue
            block_hash = next(self._hashes)
            self._cache[key] = block_hash
            run_hashes.append(block_hash)
        if run_hashes:
            run_tokens = list(tokens[run_start * size : (run_start + len(run_hashes)) * size])
            events.append(BlockStored(run_hashes, parent, run_tokens, size))
        # Used now, the last block least recently of them (vLLM frees a request's
        # blocks tail first): eviction takes a chain's tail before its start.
        for key in reversed(keys):
            if key in self._cache:
                self._cache.move_to_end(key)
        evicted: list[BlockHash] = []
        while len(self._cache) > self.model.cache_blocks:
            _, block_hash = self._cache.popitem(last=False)
            evicted.append(block_hash)
        if evicted:
            events.append(BlockRemoved(evicted))
        self._publish(events)

    def restart(self) -> None:
        """Its cache lost, as an engine that restarts loses it (counts kept)."""
        self._cache.clear()
        self._publish([AllBlocksCleared()])

    def clear(self) -> None:
        """Everything evicted (between runs): the gateways' indexes empty too."""
        self._cache.clear()
        self.counts = Counts()
        self._publish([AllBlocksCleared()])

    def _publish(self, events: list[Any]) -> None:
        if not events:
            return
        payload = _encode(EventBatch(ts=0.0, events=events))
        self._pub.send_multipart([b"", self._seq.to_bytes(8, "big"), payload])
        self._seq += 1


class Fleet:
    """``engines`` simulated engines in one process, each behind the real worker loop
    (``worker.server.WorkerServer``) on its own port, with a control socket:
    ``stats`` (every engine's counts and the floor, JSON), ``clear`` (caches,
    counts and floor emptied, between runs) and ``restart N`` (engine N
    crashes and comes back empty, ``churn``)."""

    def __init__(self, engines: int, base_port: int, events_base_port: int, model: CacheModel):
        from worker.server import WorkerServer

        described = described_tokenizer()
        tokenizer = PromptTokenizer(described)  # one for all: its kept pieces are shared
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.floor = Floor()
        self.engines = [
            SimEngine(model, tokenizer, described, self.ctx, events_base_port + i, self.floor)
            for i in range(engines)
        ]
        self.servers = []
        for i, engine in enumerate(self.engines):
            worker = settings.WorkerSettings()
            worker.link.bind = f"tcp://127.0.0.1:{base_port + i}"
            worker.link.worker_id = f"sim-{i}"
            self.servers.append(WorkerServer(worker, engine))

    def stats(self) -> dict[str, Any]:
        return {
            "engines": [asdict(e.counts) for e in self.engines],
            "floor_tokens": self.floor.tokens,
        }

    def restart(self, index: int) -> None:
        """Engine ``index`` crashes and comes back at once: its requests lost,
        its cache empty, a new incarnation in its next heartbeat."""
        server = self.servers[index]
        for task in list(server.requests.values()):
            task.cancel()
        server.liveness.incarnation = uuid.uuid4().hex
        self.engines[index].restart()

    def _drain_all(self) -> None:
        for server in self.servers:
            asyncio.get_running_loop().create_task(server.drain())

    def clear(self) -> None:
        self.floor.seen.clear()
        self.floor.tokens = 0
        for engine in self.engines:
            engine.clear()

    async def serve(self, control: str) -> None:
        from shared.zmqio import Reader

        sock = self.ctx.socket(zmq.REP)
        sock.bind(control)

        def answer(word: bytes) -> None:
            if word == b"clear":
                self.clear()
                sock.send(b"{}")
            elif word.startswith(b"restart "):
                self.restart(int(word.split()[1]) % len(self.engines))
                sock.send(b"{}")
            else:
                sock.send(json.dumps(self.stats()).encode())
            reader.after_send()

        reader: Reader[bytes] = Reader(sock, answer, multipart=False)
        reader.start()
        serving = [asyncio.create_task(server.serve()) for server in self.servers]
        await asyncio.sleep(0)  # each server set its own signal handlers: ours replace them
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._drain_all)
        try:
            await asyncio.gather(*serving)
        finally:
            reader.stop()
            sock.close(linger=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.sim_engine",
        description="SIMULATED engines with a paged prefix cache (a benchmark double).",
    )
    parser.add_argument("--engines", type=int, default=32)
    parser.add_argument("--base-port", type=int, required=True, help="engine i binds port + i")
    parser.add_argument("--events-base-port", type=int, required=True)
    parser.add_argument("--control", required=True, help="ZeroMQ address for stats/clear")
    parser.add_argument("--block-size", type=int, default=CacheModel.block_size)
    parser.add_argument("--cache-blocks", type=int, default=CacheModel.cache_blocks)
    parser.add_argument(
        "--prefill-us-per-token", type=float, default=CacheModel.prefill_s_per_token * 1e6
    )
    parser.add_argument("--step-ms", type=float, default=CacheModel.step_s * 1000)
    parser.add_argument("--capacity", type=int, default=CacheModel.capacity)
    parser.add_argument("--log-level", default="warning")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, "text")
    model = CacheModel(
        block_size=args.block_size,
        cache_blocks=args.cache_blocks,
        prefill_s_per_token=args.prefill_us_per_token / 1e6,
        step_s=args.step_ms / 1000,
        capacity=args.capacity,
    )
    log.warning(
        "SIMULATED engines: %d, a modelled prefix cache each (a benchmark double)", args.engines
    )
    fleet = Fleet(args.engines, args.base_port, args.events_base_port, model)
    try:
        import uvloop

        uvloop.run(fleet.serve(args.control))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
