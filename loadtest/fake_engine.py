"""A zero-cost FAKE engine: a benchmark and fault-injection double. Not a model.

``python -m loadtest.fake_engine`` runs the real worker loop
(:class:`worker.server.WorkerServer`: the same ROUTER socket, outbox and
heartbeats as ``llmgate worker``) around :class:`FakeEngine`, which answers
every request with ``" fake"`` tokens instead of running a model. What a
gateway in front of it spends per request is then the gateway's own cost,
which is what ``loadtest.overhead`` measures.

A request gets ``--tokens`` tokens per choice, or when that is 0 its own
``max_tokens`` (16 when unset). They come one per step: with
``--token-interval-ms 0`` a step is one turn of the event loop (so the
worker's one-frame-per-turn flush batches concurrent requests, as with a
real engine step); otherwise steps keep that fixed interval. A one-token
answer goes out as one frame, at once.

It is also the suite's fault-injection double, made controllable
(``--hold-after N --control ADDR``): each request sends its first ``N``
tokens, then waits at a gate until the test says ``release`` on the control
socket (a ZeroMQ PUSH to this PULL). A test that stops a worker, pauses a
gateway or fills a queue then knows the work is still under way when the
fault lands: "the engine finished first" cannot happen, however slow the
machine. ``hold`` closes the gate again for the requests that come after.

It never stands in for vLLM in a feature test: the prompt is not read
beyond a rough whitespace count for ``usage``, and sampling fields other
than ``n``, ``max_tokens`` and ``logprobs`` are ignored. Of vLLM's own
routes it answers only a streamed ``/v1/responses`` (``fake_responses``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from loadtest import fake_responses
from shared import protocol, settings
from shared.logs import setup_logging
from worker.engine_api import ModelEngine
from worker.errors import RequestError
from worker.prepare import PreparedPrompt

log = logging.getLogger(__name__)

TOKEN_TEXT = " fake"
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class FakeParams:
    """What the fake engine reads of a request (it stands where ``SamplingParams`` would)."""

    n: int
    max_tokens: int
    # Each token named in the deltas' logprobs, as a stream checker reads them.
    logprobs: bool = False


class Gate:
    """Where held requests wait until the test releases them (``--hold-after``)."""

    def __init__(self, after: int) -> None:
        # Tokens each choice sends before it waits; -1: never held.
        self.after = after
        self.open = after < 0
        self._changed = asyncio.Condition()

    async def wait(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.open)

    async def command(self, word: str) -> None:
        """``release``: every held request (and each later one) runs on; ``hold``: close again."""
        if word not in ("release", "hold"):
            log.warning("fake engine: unknown control command %r", word)
            return
        async with self._changed:
            self.open = word == "release"
            self._changed.notify_all()
        log.warning("fake engine: %s", word)

    async def listen(self, address: str) -> None:
        """Take commands from a ZeroMQ PULL socket bound at ``address``."""
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        try:
            while True:
                await self.command((await sock.recv()).decode(errors="replace"))
        finally:
            sock.close(0)


class FakeEngine:
    """Answers at once, or emits tokens at a fixed interval; no model, no vLLM
    import: a :class:`worker.engine_api.ModelEngine` of its own."""

    system_fingerprint = ""

    def __init__(
        self,
        served_model_names: list[str],
        tokens: int = 0,
        token_interval: float = 0.0,
        capacity: int = 1024,
        max_model_len: int = 4096,
        gate: Gate | None = None,
        token_id: int = 1,
    ) -> None:
        self.served_model_names = served_model_names
        # The id each token goes out under: a fault test that has a real
        # engine continue a double's answer gives one of the model's.
        self.token_id = token_id
        self.tokens = tokens
        self.token_interval = token_interval
        self.gate = gate or Gate(-1)
        self.max_num_seqs = capacity
        self.max_model_len = max_model_len
        self.running = 0
        self.chat_parser = False
        self.reasoning_parser = False
        self.kv_events_port = 0
        self.kv_replay_port = 0
        self.kv_block_size = 0
        self.loras: dict[str, Any] = {}

    async def start(self) -> None:
        return None

    def describe_tokenizer(self) -> tuple[str, str, dict[str, str]] | None:
        return None  # the double has no tokenizer

    def engine_priority(self, priority: int) -> int:
        return 0  # one first-come line, as vLLM's default policy

    async def passthrough(
        self, request_id: str, params: dict[str, Any], model: str = "", priority: int = 0
    ) -> AsyncIterator[list[protocol.Delta]]:
        """A streamed Responses request (``loadtest.fake_responses``); any
        other of vLLM's routes is refused: there is no vLLM server here."""
        body = params.get("body")
        if params.get("path") != "/v1/responses" or not (
            isinstance(body, dict) and body.get("stream")
        ):
            raise RequestError(503, "the FAKE engine has no vLLM server for this request")
        tokens = self.tokens or int(body.get("max_output_tokens") or DEFAULT_MAX_TOKENS)

        async def before_token(step: int) -> None:
            if step == self.gate.after:
                await self.gate.wait()
            elif self.token_interval:
                await asyncio.sleep(self.token_interval)

        self.running += 1
        try:
            async for chunk in fake_responses.events(body, TOKEN_TEXT, tokens, before_token):
                yield [protocol.Delta(request_id=request_id, index=0, raw=chunk)]
        finally:
            self.running -= 1
        yield [protocol.Delta(request_id=request_id, index=0, usage=protocol.Usage(1, tokens))]

    async def prepare(
        self,
        kind: protocol.RequestKind,
        params: dict[str, Any],
        continuation: protocol.Continuation | None = None,
    ) -> list[PreparedPrompt]:
        carried = len(continuation.token_ids) if continuation else 0
        max_tokens = (self.tokens or requested_tokens(params)) - carried
        if max_tokens <= 0:
            raise RequestError(400, "The continued answer has no tokens left to generate.")
        fake = FakeParams(
            n=int(params.get("n") or 1),
            max_tokens=max_tokens,
            # 0 asks for the sampled token's logprob alone (TGI's streams do):
            # not ``in (None, False)``, which 0 equals.
            logprobs=params.get("logprobs") is not None and params.get("logprobs") is not False,
        )
        prompt = rough_prompt_tokens(kind, params) + carried
        return [PreparedPrompt(None, fake, prompt, carried=carried)]

    async def run(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        trace: dict[str, str] | None = None,
        model: str = "",
        priority: int = 0,
    ) -> AsyncIterator[list[protocol.Delta]]:
        fake: FakeParams = prompts[0].sampling_params
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.running += 1
        try:
            for step in range(fake.max_tokens):
                if step == self.gate.after:
                    await self.gate.wait()
                    start = loop.time() - step * self.token_interval
                elif step:
                    # A schedule, not a sleep per token, so the interval does not drift.
                    delay = start + step * self.token_interval - loop.time()
                    await asyncio.sleep(max(delay, 0.0))
                last = step == fake.max_tokens - 1
                named = [protocol.TokenLogprob(TOKEN_TEXT, -1.0, token_id=self.token_id)]
                yield [
                    protocol.Delta(
                        request_id=request_id,
                        index=index,
                        text=TOKEN_TEXT,
                        num_tokens=1,
                        token_ids=[self.token_id],
                        logprobs=named if fake.logprobs else None,
                        finish_reason="length" if last else None,
                    )
                    for index in range(fake.n)
                ]
        finally:
            self.running -= 1
        prompt = prompts[0]
        usage = protocol.Usage(
            prompt.prompt_tokens - prompt.carried, fake.max_tokens * fake.n + prompt.carried
        )
        yield [protocol.Delta(request_id=request_id, index=0, usage=usage)]

    def load(self) -> tuple[int, int, float]:
        return self.running, 0, 0.0

    def shutdown(self) -> None:
        return None


def requested_tokens(params: dict[str, Any]) -> int:
    """The request's ``max_tokens`` (or chat's ``max_completion_tokens``), at least 1."""
    value = params.get("max_tokens") or params.get("max_completion_tokens")
    return max(int(value), 1) if value else DEFAULT_MAX_TOKENS


def rough_prompt_tokens(kind: protocol.RequestKind, params: dict[str, Any]) -> int:
    """Words in the prompt: a stand-in for a tokenizer's count, for ``usage`` only."""
    if kind == "chat":
        text = " ".join(str(m.get("content") or "") for m in params.get("messages", []))
    else:
        prompt = params.get("prompt", "")
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    return max(len(text.split()), 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.fake_engine",
        description="A zero-cost fake worker (benchmark double): the worker loop, no model.",
    )
    settings.add_arguments(parser, settings.WorkerSettings)
    parser.add_argument(
        "--served-model-name", default=settings.DEFAULT_MODEL_NAME, help="model name it answers"
    )
    parser.add_argument(
        "--tokens", type=int, default=0, help="tokens per choice; 0 = the request's max_tokens"
    )
    parser.add_argument(
        "--token-interval-ms", type=float, default=0.0, help="ms between tokens; 0 = every turn"
    )
    parser.add_argument(
        "--capacity", type=int, default=1024, help="requests at once it reports (max_num_seqs)"
    )
    parser.add_argument(
        "--hold-after",
        type=int,
        default=-1,
        help="fault tests: each choice sends this many tokens, then waits for 'release' (-1: off)",
    )
    parser.add_argument(
        "--control", default="", help="ZeroMQ address to bind for 'release'/'hold' commands"
    )
    parser.add_argument(
        "--token-id", type=int, default=1, help="the id its tokens go out under (fault tests)"
    )
    parser.add_argument("--log-level", default="warning")
    return parser


def main(argv: list[str] | None = None) -> None:
    from worker.server import WorkerServer

    namespace = build_parser().parse_args(argv)
    worker_settings = settings.from_namespace(settings.WorkerSettings, namespace)
    setup_logging(namespace.log_level, worker_settings.log_format)
    engine: ModelEngine
    engine = fake = FakeEngine(
        [namespace.served_model_name],
        tokens=namespace.tokens,
        token_interval=namespace.token_interval_ms / 1000,
        capacity=namespace.capacity,
        gate=Gate(namespace.hold_after),
        token_id=namespace.token_id,
    )
    log.warning("FAKE engine: answers %r tokens with no model (a benchmark double)", TOKEN_TEXT)
    try:
        _run(_serve(WorkerServer(worker_settings, engine), fake.gate, namespace.control))
    except KeyboardInterrupt:
        pass


async def _serve(server: Any, gate: Gate, control: str) -> None:
    listener = asyncio.create_task(gate.listen(control)) if control else None
    try:
        await server.serve()
    finally:
        if listener is not None:
            listener.cancel()


def _run(coroutine: Any) -> None:
    # uvloop, as the gateway uses, so the fake side is no slower than it must be.
    try:
        import uvloop
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)


if __name__ == "__main__":
    main()
