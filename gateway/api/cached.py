"""One request's use of the response cache (``gateway.cache``), for :class:`~gateway.api.call.Call`.

Before admission, :meth:`CacheStep.look_up` finds a stored answer, which
:func:`replay` serves through the request's own response builder (whole or
streamed, as the request asks, with its own id and creation time). On a
miss that may be stored, the call records the worker's deltas as they come
into ``recorded``, and :meth:`CacheStep.store` keeps the answer once it
finished normally.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgspec
from fastapi.responses import Response, StreamingResponse

from gateway import metrics
from gateway.api.headers import CACHE_HEADER, STREAM_HEADERS, WORKER_HEADER
from gateway.cache import Entry, ResponseCache, controls, in_scope, key_for
from gateway.dialects import sse
from gateway.dialects.jsonresp import JSONAnswer
from gateway.dispatch.handle import Answerer
from gateway.dispatch.pool import Pool
from gateway.dispatch.workers import Worker
from shared import protocol, routes

# The routes whose answers are cached (OpenAI's; TGI's are not).
CACHED_ROUTES = frozenset({routes.COMPLETIONS.path, routes.CHAT.path})


def cache_step(cache: ResponseCache | None, route: str, kind: str) -> CacheStep | None:
    """The request's part in the response cache, if its answers may be cached:
    OpenAI's routes, not vLLM's own answers (the cache stores our deltas)."""
    if cache is None or route not in CACHED_ROUTES or kind == "vllm":
        return None
    return CacheStep(cache, kind)


class CacheStep:
    def __init__(self, cache: ResponseCache, kind: str) -> None:
        self.cache = cache
        self.kind = kind  # completion or chat: part of the key
        self.result = ""  # hit, miss or bypass: the response header
        self.key = ""
        # A hit's usage, as its client is given it.
        self.usage: protocol.Usage | None = None
        # The worker's output as it came, while the answer may be stored.
        self.recorded: list[protocol.Delta] | None = None

    async def look_up(
        self,
        pool: Pool,
        served_model: str,
        body: dict[str, Any],
        cache_control: str | None,
        builder: sse.ResponseBuilder,
        stream: bool,
    ) -> Response | None:
        """The stored answer, replayed through ``builder``; None to compute it
        (recording it into ``recorded`` if it may be kept)."""
        workers = pool.healthy_workers()
        entry = await self._find(served_model, body, cache_control, workers)
        if entry is None:
            return None
        self.usage = entry.usage
        # Streamed in the shape its model's workers stream it (sse.Chat.chunk).
        builder.chat_parser = any(w.chat_parser for w in workers if entry.served_model in w.models)
        return replay(builder, entry, stream, builder.include_usage)

    async def _find(
        self,
        served_model: str,
        body: dict[str, Any],
        cache_control: str | None,
        workers: Iterable[Worker],
    ) -> Entry | None:
        """The stored answer for this request, if it may have one; else note
        whether its answer may be stored."""
        wanted = controls(cache_control)
        if not (wanted.read or wanted.write) or not in_scope(body, self.cache.scope):
            self._count("bypass")
            return None
        self.key = key_for(self.kind, served_model, body)
        if wanted.read:
            entry = await self.cache.get(self.key)
            if entry is not None and _fresh(entry, workers):
                self._count("hit")
                return entry
        self._count("miss")
        if wanted.write:
            self.recorded = []
        return None

    def _count(self, result: str) -> None:
        self.result = result
        metrics.add(metrics.child(metrics.CACHE_REQUESTS, result))

    async def store(
        self,
        usage: protocol.Usage,
        num_choices: int,
        answered_by: Answerer,
        headers: dict[str, str],
    ) -> None:
        """Keep an answer every choice of which stopped or hit its length, with
        its response headers but the worker's and the cache's own."""
        recorded = self.recorded
        if recorded is None:
            return
        ended = {d.index for d in recorded if d.finish_reason not in (None, "abort")}
        if len(ended) != num_choices:
            return
        entry = Entry(
            deltas=[msgspec.structs.replace(d, request_id="") for d in recorded],
            usage=usage,
            served_model=answered_by.model,
            system_fingerprint=answered_by.system_fingerprint,
            headers={k: v for k, v in headers.items() if k not in (WORKER_HEADER, CACHE_HEADER)},
        )
        await self.cache.put(self.key, entry)


def _fresh(entry: Entry, workers: Iterable[Worker]) -> bool:
    """Whether the engine that computed ``entry`` still serves its model (a
    worker of the same fingerprint; with none serving it, the entry stands)."""
    fingerprints = {w.system_fingerprint for w in workers if entry.served_model in w.models}
    return not fingerprints or entry.system_fingerprint in fingerprints


def replay(
    builder: sse.ResponseBuilder, entry: Entry, stream: bool, include_usage: bool
) -> Response:
    """A hit, through the same builder as a fresh answer."""
    builder.system_fingerprint = entry.system_fingerprint
    headers = {**entry.headers, CACHE_HEADER: "hit"}
    if not stream:
        for delta in entry.deltas:
            builder.add(delta)
        return JSONAnswer(builder.body(entry.usage), headers)

    async def events() -> AsyncIterator[bytes]:
        for delta in entry.deltas:
            yield builder.chunk(delta)
        if include_usage:
            yield builder.usage_chunk(entry.usage)
        if builder.done:
            yield builder.done

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={**STREAM_HEADERS, **headers}
    )
