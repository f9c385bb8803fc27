"""vLLM's own routes, answered by vLLM's server in a worker (``worker.vllm_app``).

The route table's ``vllm`` routes (``shared.routes``): ``/tokenize``,
``/detokenize``, ``/version``, ``/ping``, ``/invocations``,
``/v1/chat/completions/batch``, the Responses API (``/v1/responses``, and
by id) and Anthropic's ``/v1/messages``: the gateway admits and routes each
to a worker of the model it names (any worker when it names none), with
the same queue, retries, disconnect handling and metrics as a completion,
and forwards the worker's answer as vLLM's server gave it.

Chat and completion requests come here too (``gateway.api.openai_routes``) when
they use a field only vLLM's server answers: tools, prompt logprobs, beam
search, ... (``schemas.vllm_field``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from gateway import background, errors
from gateway.api import responses
from gateway.api.call import Call
from gateway.api.http import read_body
from gateway.api.services import services_of
from gateway.context import context_of
from gateway.dialects import schemas, sse
from gateway.dialects.jsonresp import json_response
from gateway.endpoints import Endpoints
from gateway.state.background import OPEN
from shared import routes


async def forward(
    request: Request,
    path: str,
    raw: dict[str, Any] | None,
    method: str = "POST",
    body: schemas._Sampling | schemas.VllmRequest | None = None,
) -> Response:
    """Run ``method path`` with body ``raw`` on vLLM's server in a worker."""
    pool = services_of(request).pool
    if body is None:
        body = schemas.validate(raw or {}, schemas.VllmRequest)
    if not body.model:
        # vLLM answers a body without a model with its first served model.
        await pool.wait_for_worker()
        served = pool.models()
        if not served:
            raise errors.NoWorker("No worker is serving any model.")
        body.model = served[0]
    wire = {"method": method, "path": path, "body": raw}
    call = Call(request, "vllm", path, raw or {}, body, sse.Passthrough(body.model), wire=wire)
    return await call.serve(lambda limit: "")


def _poster(path: str) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint that forwards a POST to ``path`` with its JSON body."""

    async def post(request: Request) -> Response:
        raw = schemas.decode_body(
            await read_body(request, services_of(request).settings.http.max_body_bytes)
        )
        return await forward(request, path, raw)

    post.__name__ = "post_" + path.strip("/").replace("/", "_")
    return post


async def version(request: Request) -> Response:
    return await forward(request, routes.VERSION.path, None, "GET")


async def ping(request: Request) -> Response:
    return await forward(request, routes.PING.path, None, "GET")


async def ping_post(request: Request) -> Response:
    return await forward(request, routes.PING.path, None, "POST")


async def create_response(request: Request) -> Response:
    raw = schemas.decode_body(
        await read_body(request, services_of(request).settings.http.max_body_bytes)
    )
    store = services_of(request).store
    await responses.check_id(store, raw, context_of(request.scope).owner)
    previous_id = raw.get("previous_response_id")
    previous = None
    if isinstance(previous_id, str) and previous_id:
        previous = await responses.load(store, previous_id, context_of(request.scope).viewer)
    if raw.get("background"):
        return await _create_background(request, raw, previous, previous_id)
    if previous is None and not raw.get("store", True):
        return await forward(request, routes.RESPONSES.path, raw)  # nothing to keep or expand
    recorder = responses.Recorder(
        store, raw, previous, str(previous_id) if previous else "", context_of(request.scope).owner
    )
    wire = responses.continued(raw, previous) if previous is not None else raw
    keep = raw.get("store", True)
    response = await forward(request, routes.RESPONSES.path, wire)
    if response.status_code != 200:
        return response
    if isinstance(response, StreamingResponse):
        if keep or previous is not None:
            response.body_iterator = recorder.stream(response.body_iterator, save=keep)
        return response
    content = bytes(response.body)
    patched = await recorder.whole(content) if keep else recorder.patch(content)
    return Response(patched, media_type=response.media_type, headers=_headers(response))


async def _create_background(
    request: Request, raw: dict[str, Any], previous: responses.Record | None, previous_id: Any
) -> Response:
    """Store it queued for a runner (``gateway.background``); the response
    now, or, with ``stream``, its events as they come."""
    services = services_of(request)
    body = schemas.validate(raw, schemas.VllmRequest)
    if not body.model:
        await services.pool.wait_for_worker()
        served = services.pool.models()
        if not served:
            raise errors.NoWorker("No worker is serving any model.")
        body.model = served[0]
    context = context_of(request.scope)
    if context.key is not None and not context.key.allows(body.model):
        raise errors.Forbidden(
            f"The API key {context.key.name!r} may not use the model `{body.model}`.", "model"
        )
    wire = responses.continued(raw, previous) if previous is not None else raw
    created = await background.create(
        services.store,
        services.background,
        wire,
        body.model,
        str(previous_id) if previous is not None else "",
        context.owner,
    )
    if not raw.get("stream"):
        return json_response(created)
    return await _events(request, created["id"], -1)


async def _events(request: Request, response_id: str, after: int) -> Response:
    """A background response's stream after event ``after``, from the store."""
    services = services_of(request)
    viewer = context_of(request.scope).viewer
    path = routes.RESPONSES.path
    stream = await background.events(
        services.store, services.background, path, response_id, after, viewer
    )
    if stream is not None:
        return stream
    if await responses.load(services.store, response_id, viewer) is None:
        raise responses.not_found(response_id)
    raise errors.BadRequest(
        f"Response {response_id!r} was not created with `background`: only a "
        "background response's events are kept to stream again.",
        "stream",
    )


def _starting_after(request: Request) -> int:
    given = request.query_params.get("starting_after")
    if given is None:
        return -1
    try:
        after = int(given)
    except ValueError:
        after = -2
    if after < -1:
        raise errors.BadRequest(
            f"`starting_after` must be an event's sequence number (0 or more), not {given!r}.",
            "starting_after",
        )
    return after


# GET and cancel by id answer from the store alone, never from a worker: the
# gateway stores every response it was asked to store, so an id it does not
# hold (for this key) is unknown or another key's. What a worker's vLLM keeps
# besides is only a `background` response, in that worker's process, owned by
# no key: forwarding would let any key read or cancel it, and the pool would
# send the request to any worker of the model, not the one that ran it.
async def retrieve_response(request: Request, response_id: str) -> Response:
    if request.query_params.get("stream", "").lower() == "true":
        return await _events(request, response_id, _starting_after(request))
    store = services_of(request).store
    stored = await responses.load(store, response_id, context_of(request.scope).viewer)
    if stored is None:
        raise responses.not_found(response_id)
    return json_response(stored.response)


def _headers(response: Response) -> dict[str, str]:
    """A response's own headers (llmgate's), less those a new body changes."""
    return {
        k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")
    }


async def cancel_response(request: Request, response_id: str) -> Response:
    services = services_of(request)
    store = services.store
    viewer = context_of(request.scope).viewer
    cancelled = await store.call(store.background.cancel, response_id, viewer)
    if cancelled is not None:
        before, record = cancelled
        if before in OPEN:
            services.background.stop_one(response_id)  # if this process runs it
            services.background.changed(response_id)  # its readers, on every replica
        elif before != "cancelled":
            raise errors.BadRequest(
                f"Cannot cancel a response that has already ended ({before}).", "response_id"
            )
        return json_response(msgspec.json.decode(record, type=responses.Record).response)
    if await responses.load(store, response_id, context_of(request.scope).viewer) is None:
        raise responses.not_found(response_id)
    # A stored response has ended (only completed and incomplete ones are
    # stored): vLLM's server answers the same for one that is not running.
    raise errors.BadRequest("Cannot cancel a synchronous response.", "response_id")


_OWN: Endpoints = {
    (routes.VERSION, "GET"): version,
    (routes.PING, "GET"): ping,
    (routes.PING, "POST"): ping_post,
    (routes.RESPONSES, "POST"): create_response,
    (routes.RESPONSE, "GET"): retrieve_response,
    (routes.RESPONSE_CANCEL, "POST"): cancel_response,
}

# What this module answers (gateway.app wires every module's table): the
# routes above, and a POST to any other of vLLM's routes, its JSON body sent
# to vLLM's server as it came.
ENDPOINTS: Endpoints = {
    **_OWN,
    **{
        (route, "POST"): _poster(route.path)
        for route in routes.ROUTES
        if route.kind == "vllm" and "POST" in route.methods and (route, "POST") not in _OWN
    },
}
