"""Background responses (the Responses API's ``background: true``) and resumable
streams, run by the gateway.

``POST /v1/responses`` with ``background`` stores the request and its
response (``queued``) in the state store and answers at once (or streams it,
with ``stream``); a :class:`Runner` of any gateway process or replica runs it
(``runner``), storing its stream's events as they come; any replica answers
``GET /v1/responses/{id}`` (its status, then the whole response),
``GET ...?stream=true&starting_after=N`` (the events after N, then the rest
as they come: ``follow``) and ``POST .../cancel``. A replica that dies
mid-answer leaves its lease to lapse; another runs the response again and
goes on after the events sent (``splice``). What vLLM's server does with
``background`` stays in one worker process, owned by no key: the workers
never see it. A chat or completion stream sent with ``x-llmgate-resumable``
runs the same way (:func:`start_stream`): each event has an SSE ``id``, and
the same request sent again with ``Last-Event-ID`` resumes it after that
event through any replica (``kinds``).
"""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Any

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp

from gateway import errors
from gateway.api import request_ids
from gateway.api.auth import KeyRing
from gateway.api.headers import STREAM_HEADERS
from gateway.api.responses import Record, input_items
from gateway.background.follow import Notices, follow, opened
from gateway.background.kinds import kind_of
from gateway.background.runner import Runner
from gateway.state import State
from gateway.state.response_store import IdTaken
from shared.settings import RoutingSettings, StoreSettings

__all__ = ["Notices", "Runner", "create", "events", "start", "start_stream"]

# A seed for a sampled request that has none: a run again draws the same tokens.
SEED_BOUND = 2**31


def start(
    settings: StoreSettings,
    routing: RoutingSettings,
    state: State,
    app: ASGIApp,
    keys: KeyRing | None = None,
) -> Runner:
    """Start this process's runner (inside the running loop); it waits for the store."""
    runner = Runner(state, app, settings.background_lease_seconds, routing.max_migrations, keys)
    runner.start()
    return runner


async def create(
    state: State,
    runner: Runner,
    body: dict[str, Any],
    model: str,
    previous_id: str,
    owner: str | None,
) -> dict[str, Any]:
    """Store a queued background response for ``body`` (the conversation of
    ``previous_id``, if any, already in its input) and wake the runner; the
    response as it is now."""
    if body.get("store") is False:
        raise errors.BadRequest(
            "A background response is stored: `background` needs `store` true (the default).",
            "store",
        )
    chosen = body.get("request_id")
    response_id = chosen if isinstance(chosen, str) and chosen else f"resp_{uuid.uuid4().hex}"
    # Kept as short as X-Request-Id: the store's notices carry it.
    if not request_ids.fits(response_id):
        raise errors.BadRequest(
            f"`request_id` must be 1 to {request_ids.MAX_LENGTH} printable ASCII characters "
            "without spaces.",
            "request_id",
        )
    wire = {k: v for k, v in body.items() if k not in ("background", "previous_response_id")}
    wire.update(stream=True, store=False, request_id=response_id, model=model)
    seeded(wire)
    response = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "queued",
        "background": True,
        "store": True,
        "model": model,
        "output": [],
        "previous_response_id": previous_id or None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "error": None,
        "incomplete_details": None,
        "usage": None,
    }
    record = msgspec.json.encode(Record(response, input_items(body)))
    try:
        await state.call(
            state.background.create, response_id, owner, msgspec.json.encode(wire), record
        )
    except IdTaken:
        raise errors.BadRequest(
            f"`request_id` {response_id!r} is already the id of a stored response; choose another.",
            "request_id",
        ) from None
    runner.wake()
    return response


def seeded(body: dict[str, Any]) -> None:
    """Give a request a seed if it has none: a run again draws the same tokens."""
    if body.get("seed") is None:
        body["seed"] = secrets.randbelow(SEED_BOUND)


async def start_stream(
    state: State, runner: Runner, path: str, body: dict[str, Any], owner: str | None
) -> str:
    """Store a chat or completion stream (``body``) for the runner; its id."""
    stream_id = uuid.uuid4().hex
    wire = {**body, "stream": True}
    seeded(wire)
    await state.call(
        state.background.create, stream_id, owner, msgspec.json.encode(wire), None, path
    )
    runner.wake()
    return stream_id


async def events(
    state: State, runner: Runner, path: str, stream_id: str, after: int, viewer: str | None
) -> StreamingResponse | None:
    """The stream of ``path`` after its event ``after``, from the store; None
    if ``viewer`` has no such stream."""
    first = await opened(state, stream_id, after, viewer, path)
    if first is None:
        return None
    body = follow(state, runner.notices, kind_of(path), path, stream_id, after, first, viewer)
    return StreamingResponse(body, media_type="text/event-stream", headers=STREAM_HEADERS)
