"""A zero-cost OpenAI HTTP backend: raw ASGI on uvicorn, no model, no framework.

The HTTP twin of ``loadtest.fake_engine``: it answers ``/v1/completions`` and
``/v1/chat/completions`` with ``" fake"`` tokens (``--tokens`` per request,
or the request's ``max_tokens``; one SSE chunk per token when streaming, on
the same schedule as the fake engine), and ``/v1/models`` and ``/health``
as vLLM's server does. ``loadtest.overhead`` hits it directly (the baseline
every added latency is measured from) and through vllm-router, so that what
a router adds can be set beside what the gateway adds over the fake worker.

Run it::

    .venv/bin/python -m loadtest.zero_cost_http --port 8100 [--tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from loadtest.fake_engine import TOKEN_TEXT, requested_tokens, rough_prompt_tokens
from shared.settings import DEFAULT_MODEL_NAME

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
DONE = b"data: [DONE]\n\n"
encode = msgspec.json.encode


class ZeroCostApp:
    """The ASGI app; ``tokens`` 0 means each request's own ``max_tokens``."""

    def __init__(
        self, model: str = DEFAULT_MODEL_NAME, tokens: int = 0, token_interval: float = 0.0
    ) -> None:
        self.model = model
        self.tokens = tokens
        self.token_interval = token_interval
        self._ids = itertools.count()
        self._models = encode(
            {
                "object": "list",
                "data": [{"id": model, "object": "model", "created": 0, "owned_by": "zero-cost"}],
            }
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            body = await _read_body(receive)
            try:
                params = msgspec.json.decode(body)
            except msgspec.DecodeError:
                await _respond(send, 400, b'{"error":{"message":"invalid JSON"}}')
                return
            kind = "chat" if path == "/v1/chat/completions" else "completion"
            await self._generate(send, kind, params)
        elif method == "GET" and path == "/v1/models":
            await _respond(send, 200, self._models)
        elif method == "GET" and path in ("/health", "/ping", "/version"):
            await _respond(send, 200, b"{}")
        else:
            await _respond(send, 404, b'{"error":{"message":"not found"}}')

    async def _generate(self, send: Send, kind: str, params: dict[str, Any]) -> None:
        tokens = self.tokens or requested_tokens(params)
        chat = kind == "chat"
        envelope = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-zc{next(self._ids)}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": params.get("model", self.model),
        }
        usage = {
            "prompt_tokens": rough_prompt_tokens("chat" if chat else "completion", params),
            "completion_tokens": tokens,
        }
        usage["total_tokens"] = usage["prompt_tokens"] + tokens
        if not params.get("stream"):
            text = TOKEN_TEXT * tokens
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["stop_reason"] = None
            await _respond(send, 200, encode({**envelope, "choices": [choice], "usage": usage}))
            return
        envelope["object"] = "chat.completion.chunk" if chat else "text_completion"
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        loop = asyncio.get_running_loop()
        start = loop.time()
        for step in range(tokens):
            if step:
                # The fake engine's schedule: one token per loop turn, or a fixed interval.
                await asyncio.sleep(max(start + step * self.token_interval - loop.time(), 0.0))
            finish = "length" if step == tokens - 1 else None
            if chat:
                delta = {"role": "assistant", "content": TOKEN_TEXT} if not step else None
                choice = {"index": 0, "delta": delta or {"content": TOKEN_TEXT}}
            else:
                choice = {"index": 0, "text": TOKEN_TEXT}
            # The fields vLLM (and the gateway) send, so chunks weigh the same.
            choice.update(logprobs=None, finish_reason=finish, stop_reason=None)
            chunk = b"data: " + encode({**envelope, "choices": [choice]}) + b"\n\n"
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON_HEADERS})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m loadtest.zero_cost_http",
        description="A zero-cost OpenAI HTTP backend (benchmark double): no model.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--tokens", type=int, default=0, help="0 = the request's max_tokens")
    parser.add_argument("--token-interval-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    app = ZeroCostApp(args.model, args.tokens, args.token_interval_ms / 1000)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
