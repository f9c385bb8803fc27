"""The seeds' baseline: a FastAPI app batching requests into Hugging Face ``generate``.

This is the design seed 000 measured (a FastAPI daemon with a dynamic
batching loop), written at its best so that beating it means something:

* requests queue up; a batching loop takes the first and waits up to
  ``--batch-timeout`` (100 ms) for more, up to ``--max-batch`` (50), then runs
  one ``generate`` for the whole batch in a thread, so the event loop keeps
  accepting (and queueing the next batch) meanwhile;
* the same model directory and dtype (float32) as the vLLM targets, left
  padding, greedy decoding, the KV cache, ``torch.inference_mode``;
* one torch thread per usable core (``--threads``): on this 2-core machine
  2 threads measured 128 output tokens/s against 112 with 1 (the number a
  lone vLLM engine computes with, keeping a core for its front end), so the
  baseline gets the faster setting;
* tokens stream as ``generate`` makes them (a streamer sees each step's batch
  of new tokens), so TTFT and ITL are measured as for the engines.

What it cannot do, by design: admit a request into a running batch
(continuous batching) or share a prompt's KV cache between requests; a
request waits for the batch in progress to finish before its own starts.

It serves ``POST /v1/completions`` (string prompt, ``max_tokens``,
``stream``, ``stream_options.include_usage``, ``ignore_eos``; sampling is
always greedy) and ``GET /health``::

    python -m loadtest.baselines.fastapi_batching --model-dir .models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

MODEL_NAME = "smollm2-135m-instruct"


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionBody(BaseModel):
    prompt: str
    max_tokens: int = 16
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # Accepted so the bench's greedy requests validate; decoding is greedy anyway.
    temperature: float | None = None


@dataclass
class Pending:
    """One request waiting for, or inside, a batch. ``tokens`` gets ids, then None."""

    prompt: str
    max_tokens: int
    ignore_eos: bool
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    produced: int = 0
    done: bool = False
    finish_reason: str = "length"
    prompt_tokens: int = 0


class _BatchStreamer(BaseStreamer):
    """Hands each generation step's tokens (one per row) to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, batcher: Batcher, batch: list[Pending]):
        self.loop = loop
        self.batcher = batcher
        self.batch = batch
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:  # generate() first pushes the prompt ids
            self.seen_prompt = True
            return
        tokens = value.reshape(-1).tolist()
        self.loop.call_soon_threadsafe(self.batcher.dispatch, self.batch, tokens)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.batcher.finish, self.batch)


class Batcher:
    """The dynamic batching loop around one model."""

    def __init__(self, model: Any, tokenizer: Any, max_batch: int, timeout: float) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.timeout = timeout
        self.eos_id = int(tokenizer.eos_token_id)
        self.incoming: asyncio.Queue[Pending] = asyncio.Queue()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.incoming.get()]
            deadline = loop.time() + self.timeout
            while len(batch) < self.max_batch:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.incoming.get(), remaining))
                except TimeoutError:
                    break
            try:
                await asyncio.to_thread(self.generate, batch, loop)
            except Exception as exc:  # fail this batch's requests, keep serving
                print(f"generate failed: {exc!r}", flush=True)
            self.finish(batch)

    def generate(self, batch: list[Pending], loop: asyncio.AbstractEventLoop) -> None:
        inputs = self.tokenizer([p.prompt for p in batch], return_tensors="pt", padding=True)
        inputs = inputs.to(self.model.device)
        for pending, mask in zip(batch, inputs["attention_mask"], strict=True):
            pending.prompt_tokens = int(mask.sum())
        max_new = max(p.max_tokens for p in batch)
        with torch.inference_mode():
            self.model.generate(
                **inputs,
                max_new_tokens=max_new,
                # EOS is suppressed only when every request asked for that.
                min_new_tokens=max_new if all(p.ignore_eos for p in batch) else None,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
                streamer=_BatchStreamer(loop, self, batch),
            )

    def dispatch(self, batch: list[Pending], tokens: list[int]) -> None:
        for pending, token in zip(batch, tokens, strict=True):
            if pending.done:
                continue
            if token == self.eos_id and not pending.ignore_eos:
                self._close(pending, "stop")
                continue
            pending.tokens.put_nowait(token)
            pending.produced += 1
            if pending.produced >= pending.max_tokens:
                self._close(pending, "length")

    def finish(self, batch: list[Pending]) -> None:
        for pending in batch:
            if not pending.done:
                self._close(pending, "stop")

    @staticmethod
    def _close(pending: Pending, reason: str) -> None:
        pending.done = True
        pending.finish_reason = reason
        pending.tokens.put_nowait(None)


class Detokenizer:
    """Incremental text of a growing list of token ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = str(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        if text.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta


def create_app(args: argparse.Namespace) -> FastAPI:
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"  # decoder-only: new tokens follow every prompt directly
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = resolve_device(args.device)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=resolve_dtype(args.dtype, device)
    )
    model.to(device)
    model.eval()  # type: ignore[no-untyped-call]
    batcher = Batcher(model, tokenizer, args.max_batch, args.batch_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # One batch before serving, as vLLM warms up before it reports ready.
        warm = Pending("Hello", 4, True)
        await asyncio.to_thread(batcher.generate, [warm], asyncio.get_running_loop())
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody) -> JSONResponse | StreamingResponse:
        if body.max_tokens < 1:
            raise HTTPException(400, "max_tokens must be >= 1")
        pending = Pending(body.prompt, body.max_tokens, body.ignore_eos)
        await batcher.incoming.put(pending)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        base = {"id": request_id, "created": created, "model": body.model or MODEL_NAME}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(pending, tokenizer, base, include_usage), media_type="text/event-stream"
            )
        detok = Detokenizer(tokenizer)
        text = ""
        while (token := await pending.tokens.get()) is not None:
            text += detok.add(token)
        choice = {"index": 0, "text": text, "finish_reason": pending.finish_reason}
        return JSONResponse(
            {**base, "object": "text_completion", "choices": [choice], "usage": _usage(pending)}
        )

    return app


def _usage(pending: Pending) -> dict[str, int]:
    return {
        "prompt_tokens": pending.prompt_tokens,
        "completion_tokens": pending.produced,
        "total_tokens": pending.prompt_tokens + pending.produced,
    }


async def _sse(
    pending: Pending, tokenizer: Any, base: dict[str, Any], include_usage: bool
) -> AsyncIterator[str]:
    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {**base, "object": "text_completion", "choices": choices, **extra}
        return f"data: {json.dumps(chunk)}\n\n"

    detok = Detokenizer(tokenizer)
    while (token := await pending.tokens.get()) is not None:
        delta = detok.add(token)
        if delta:
            yield event([{"index": 0, "text": delta, "finish_reason": None}])
    yield event([{"index": 0, "text": "", "finish_reason": pending.finish_reason}])
    if include_usage:
        yield event([], usage=_usage(pending))
    yield "data: [DONE]\n\n"


def resolve_device(name: str) -> str:
    """``auto``: the first GPU when torch sees one (a GPU host's run), else the CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto``: float32 on CPU (as every bench target there), bfloat16 on a GPU."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)  # type: ignore[no-any-return]


def default_threads() -> int:
    """Every usable core: measured faster here than leaving one to the event loop."""
    return len(os.sched_getaffinity(0))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.baselines.fastapi_batching",
        description="FastAPI + dynamic batching over transformers generate (the seeds' baseline).",
    )
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--max-batch", type=int, default=50)
    parser.add_argument("--batch-timeout", type=float, default=0.1, help="seconds")
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
