"""OpenAI's HTTP API: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

A request reads top to bottom: parse and check the body (``schemas``), then
:class:`~gateway.api.call.Call` admits it, runs it on a worker and turns the
worker's deltas into JSON or SSE (``sse``). Errors are raised as
``gateway.errors`` and rendered by the app's one handler.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway.api import resumable, vllm_routes
from gateway.api.call import Call
from gateway.api.http import read_body
from gateway.api.services import services_of
from gateway.context import context_of
from gateway.dialects import schemas, sse
from gateway.dialects.jsonresp import json_response
from gateway.dispatch.pool import Pool
from gateway.endpoints import Endpoints
from shared import routes


async def list_models(request: Request) -> Response:
    pool = services_of(request).pool
    await pool.wait_for_worker()
    served = pool.models()
    # Aliases (``alias_for``) and the auto name (``routes_to``) follow the
    # models the workers serve (--config).
    entries: list[dict[str, Any]] = [{"id": model} for model in served]
    entries += pool.listing(served)
    entry = context_of(request.scope).key
    if entry is not None:  # a key sees the models it may use
        entries = [item for item in entries if entry.allows(item["id"])]
    data = [
        {"object": "model", "created": pool.started_at, "owned_by": "llmgate", **entry}
        for entry in entries
    ]
    return json_response({"object": "list", "data": data})


async def create_completion(request: Request) -> Response:
    context = context_of(request.scope)
    if context.last_event_id is not None:
        return await resumable.resume(request, routes.COMPLETIONS.path, context.last_event_id)
    settings = services_of(request).settings.http
    raw = schemas.decode_body(await read_body(request, settings.max_body_bytes))
    body = schemas.validate(raw, schemas.CompletionRequest)
    schemas.check_limits(body, settings)
    if context.resumable is not None and resumable.asked(context, body):
        return await resumable.begin(request, routes.COMPLETIONS.path, raw, body)
    if schemas.vllm_field("completion", raw) is not None:
        return await vllm_routes.forward(request, routes.COMPLETIONS.path, raw, body=body)
    builder = sse.Completion("", body.model, body.n * _num_prompts(body.prompt), body.logprobs)
    call = Call(request, "completion", routes.COMPLETIONS.path, raw, body, builder)
    return await call.serve(lambda limit: _prompt_key(body.prompt, limit))


async def create_chat_completion(request: Request) -> Response:
    context = context_of(request.scope)
    if context.last_event_id is not None:
        return await resumable.resume(request, routes.CHAT.path, context.last_event_id)
    settings = services_of(request).settings.http
    raw = schemas.decode_body(await read_body(request, settings.max_body_bytes))
    body = schemas.validate(raw, schemas.ChatCompletionRequest)
    schemas.check_limits(body, settings)
    if context.resumable is not None and resumable.asked(context, body):
        return await resumable.begin(request, routes.CHAT.path, raw, body)
    if schemas.vllm_field("chat", raw) is not None or _reasoning(
        services_of(request).pool, body.model
    ):
        return await vllm_routes.forward(request, routes.CHAT.path, raw, body=body)
    builder = sse.Chat("", body.model, body.n, body.logprobs, body.top_logprobs or 0)
    call = Call(request, "chat", routes.CHAT.path, raw, body, builder)
    return await call.serve(lambda limit: _messages_key(body.messages, limit))


def _reasoning(pool: Pool, model: str) -> bool:
    """Whether a worker for ``model`` splits chats into reasoning and content
    (``--reasoning-parser``): vLLM's server answers those chats. A name no
    worker serves (an alias, ``auto``) counts every worker."""
    workers = pool.healthy_workers()
    serving = [w for w in workers if model in w.models] or workers
    return any(w.reasoning_parser for w in serving)


def _num_prompts(prompt: str | list[Any]) -> int:
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _prompt_key(prompt: str | list[Any], limit: int) -> str:
    """The first ``limit`` characters of the prompt (token ids as their repr)."""
    return (prompt if isinstance(prompt, str) else repr(prompt[:limit]))[:limit]


def _messages_key(messages: list[schemas.ChatMessage], limit: int) -> str:
    """The conversation's identity: its leading system/developer messages and
    first other message, each cut to ``limit`` characters, roles included.

    Every turn of a conversation starts with these, so all its turns go to
    the worker whose prefix cache holds its history; conversations that
    share a long system prompt still spread by their first user message
    (the first ``limit`` characters alone would send them all one way).
    """
    parts = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content)
        parts.append(f"{message.role}:{(content or '')[:limit]}")
        if message.role not in ("system", "developer"):
            break
    return "\n".join(parts)


# What this module answers (gateway.app wires every module's table).
ENDPOINTS: Endpoints = {
    (routes.MODELS, "GET"): list_models,
    (routes.COMPLETIONS, "POST"): create_completion,
    (routes.CHAT, "POST"): create_chat_completion,
}
