"""vLLM's own routes, answered by vLLM's server in a worker (``worker.vllm_app``).

``/tokenize``, ``/detokenize``, ``/version``, ``/ping``, ``/invocations``,
``/v1/chat/completions/batch``, the Responses API (``/v1/responses``, and
by id) and Anthropic's ``/v1/messages``: the gateway admits and routes each
to a worker of the model it names (any worker when it names none), with
the same queue, retries, disconnect handling and metrics as a completion,
and forwards the worker's answer as vLLM's server gave it.

Chat and completion requests come here too (``gateway.api.openai``) when
they use a field only vLLM's server answers: tools, prompt logprobs, beam
search, ... (``schemas.vllm_field``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway import errors, schemas, sse
from gateway.api.call import Call, pool_of
from gateway.api.http import read_body

router = APIRouter(tags=["vLLM"])


async def forward(
    request: Request,
    path: str,
    raw: dict[str, Any] | None,
    method: str = "POST",
    body: schemas._Sampling | schemas.VllmRequest | None = None,
) -> Response:
    """Run ``method path`` with body ``raw`` on vLLM's server in a worker."""
    pool = pool_of(request)
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


async def _post(request: Request, path: str) -> Response:
    pool = pool_of(request)
    raw = schemas.decode_body(await read_body(request, pool.settings.max_body_bytes))
    return await forward(request, path, raw)


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    return await _post(request, "/tokenize")


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    return await _post(request, "/detokenize")


@router.get("/version")
async def version(request: Request) -> Response:
    return await forward(request, "/version", None, "GET")


@router.get("/ping")
async def ping(request: Request) -> Response:
    return await forward(request, "/ping", None, "GET")


@router.post("/ping")
async def ping_post(request: Request) -> Response:
    return await forward(request, "/ping", None, "POST")


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    return await _post(request, "/invocations")


@router.post("/v1/chat/completions/batch")
async def chat_batch(request: Request) -> Response:
    return await _post(request, "/v1/chat/completions/batch")


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    return await _post(request, "/v1/responses")


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    return await forward(request, f"/v1/responses/{response_id}", None, "GET")


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    return await forward(request, f"/v1/responses/{response_id}/cancel", None, "POST")


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    return await _post(request, "/v1/messages")


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    return await _post(request, "/v1/messages/count_tokens")
