"""OpenAI's HTTP API: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

A request reads top to bottom: parse and check the body (``schemas``), hand it
to a worker (``pool``), turn the worker's deltas into JSON or SSE (``sse``).
Errors are raised as ``gateway.errors`` and rendered by the app's one handler.
A streaming response starts only once the worker has produced its first
delta, so errors the engine finds up front (a prompt longer than the context,
a bad parameter) still get a proper status code rather than a 200 stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from gateway import errors, schemas, sse
from gateway.pool import Pool, RequestHandle
from shared import protocol

log = logging.getLogger(__name__)

router = APIRouter()

JSON = "application/json"


def _pool(request: Request) -> Pool:
    pool: Pool = request.app.state.pool
    return pool


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    pool = _pool(request)
    await pool.wait_for_worker()
    data = [
        {"id": model, "object": "model", "created": pool.started_at, "owned_by": "llmgate"}
        for model in pool.models()
    ]
    return Response(sse._encode({"object": "list", "data": data}), media_type=JSON)


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    raw = schemas.decode_body(await request.body())
    body = schemas.validate(raw, schemas.CompletionRequest)
    if body.echo:
        raise errors.BadRequest("echo is not supported yet.", "echo")
    if body.suffix is not None:
        raise errors.BadRequest("suffix is not supported by this model.", "suffix")
    builder = sse.Completion("", body.model, body.n * _num_prompts(body.prompt), body.logprobs)
    return await _serve(request, "completion", raw, body, builder)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    raw = schemas.decode_body(await request.body())
    body = schemas.validate(raw, schemas.ChatCompletionRequest)
    builder = sse.Chat("", body.model, body.n, body.logprobs, body.top_logprobs or 0)
    return await _serve(request, "chat", raw, body, builder)


def _num_prompts(prompt: str | list[Any]) -> int:
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return 1
    return len(prompt)


async def _serve(
    request: Request,
    kind: protocol.RequestKind,
    raw: dict[str, Any],
    body: schemas._Sampling,
    builder: sse._Response,
) -> Response:
    pool = _pool(request)
    timeout = pool.settings.request_timeout or None
    deadline = time.time() + timeout if timeout else 0.0
    handle = await pool.submit(kind, body.model, raw, deadline)
    builder.id = builder.id_prefix + handle.request_id
    try:
        if not body.stream:
            return await _collect(handle, builder, deadline)
        first = await _next(handle, deadline)
    except BaseException:
        handle.close()
        raise
    if isinstance(first, protocol.Failed):
        handle.close()
        raise errors.from_status(first.status, first.message, first.param)
    return StreamingResponse(
        _stream(handle, builder, first, deadline, body.include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _next(handle: RequestHandle, deadline: float) -> protocol.Delta | protocol.Failed:
    if not deadline:
        return await handle.next()
    try:
        async with asyncio.timeout(deadline - time.time()):
            return await handle.next()
    except TimeoutError:
        raise errors.Timeout("The request timed out.") from None


async def _collect(handle: RequestHandle, builder: sse._Response, deadline: float) -> Response:
    try:
        while True:
            item = await _next(handle, deadline)
            if isinstance(item, protocol.Failed):
                raise errors.from_status(item.status, item.message, item.param)
            if item.usage is not None:
                return Response(builder.body(item.usage), media_type=JSON)
            builder.add(item)
    finally:
        handle.close()


async def _stream(
    handle: RequestHandle,
    builder: sse._Response,
    first: protocol.Delta,
    deadline: float,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    # Runs inside the response: a client that goes away cancels it here, and
    # the finally clause aborts the request on the worker.
    try:
        item: protocol.Delta | protocol.Failed = first
        while True:
            if isinstance(item, protocol.Failed):
                yield sse.event(errors.from_status(item.status, item.message, item.param).body())
                break
            if item.usage is not None:
                if include_usage:
                    yield builder.usage_chunk(item.usage)
                break
            yield builder.chunk(item)
            try:
                item = await _next(handle, deadline)
            except errors.GatewayError as exc:
                yield sse.event(exc.body())
                break
        yield sse.DONE
    finally:
        handle.close()
