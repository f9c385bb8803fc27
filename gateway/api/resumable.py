"""Resumable chat and completion streams: ``x-llmgate-resumable`` and ``Last-Event-ID``.

A streamed chat or completion request with the header ``x-llmgate-resumable:
true`` runs as a background stream (``gateway.background``): a gateway's
runner runs it and stores each chunk, and the client reads the chunks from
the store, each with an SSE ``id`` (``{stream}:{n}``). A client whose
connection dropped sends the request again (any body) with
``Last-Event-ID`` set to the last id it read, through any replica, and gets
every later chunk once, then ``[DONE]``. A replica that dies mid-answer
leaves the stream to another, as for a background response. A stream is
its key's: another key's id is unknown (404).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway import background, errors
from gateway.api.services import services_of
from gateway.context import RequestContext, context_of
from gateway.dialects import schemas

TRUE = ("1", "true", "yes", "on")
# The answer's header naming the stream (before its first event's id does).
STREAM_ID_HEADER = "x-llmgate-stream-id"


def asked(context: RequestContext, body: schemas._Sampling) -> bool:
    """Whether the request asks for a resumable stream."""
    return bool(body.stream) and (context.resumable or "").lower() in TRUE


async def begin(
    request: Request, path: str, raw: dict[str, Any], body: schemas._Sampling
) -> Response:
    """Store the stream for the runner; its chunks as they come."""
    services = services_of(request)
    context = context_of(request.scope)
    if context.key is not None and not context.key.allows(body.model):
        raise errors.Forbidden(
            f"The API key {context.key.name!r} may not use the model `{body.model}`.", "model"
        )
    stream_id = await background.start_stream(
        services.store, services.background, path, raw, context.owner
    )
    response = await _from(request, path, stream_id, -1)
    response.headers[STREAM_ID_HEADER] = stream_id
    return response


async def resume(request: Request, path: str, last_event_id: str) -> Response:
    """The stream named by ``Last-Event-ID`` after that event."""
    stream_id, _, number = last_event_id.strip().rpartition(":")
    if not stream_id or not number.isdigit():
        raise errors.BadRequest(
            f"`Last-Event-ID` {last_event_id!r} is not an id this gateway gave "
            "(`{stream}:{n}`, from a resumable stream).",
            "Last-Event-ID",
        )
    return await _from(request, path, stream_id, int(number))


async def _from(request: Request, path: str, stream_id: str, after: int) -> Response:
    services = services_of(request)
    viewer = context_of(request.scope).viewer
    stream = await background.events(
        services.store, services.background, path, stream_id, after, viewer
    )
    if stream is None:
        raise errors.NotFound(f"No resumable stream {stream_id!r} of {path}.", "Last-Event-ID")
    return stream
