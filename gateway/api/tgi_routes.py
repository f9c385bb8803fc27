"""TGI's generate routes: ``POST /generate``, ``/generate_stream`` and ``/``.

``/`` is TGI's compatibility route, the one its Python client posts to: it
streams when the body says ``"stream": true`` and otherwise answers a
one-element list. The mapping itself lives in :mod:`gateway.dialects.tgi`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway import errors
from gateway.api.call import Call
from gateway.api.http import read_body
from gateway.api.services import services_of
from gateway.dialects import schemas, tgi
from gateway.endpoints import Endpoints
from shared import routes


async def generate(request: Request) -> Response:
    return await _serve(request, routes.TGI_GENERATE.path, stream=False)


async def generate_stream(request: Request) -> Response:
    return await _serve(request, routes.TGI_GENERATE_STREAM.path, stream=True)


async def compat_generate(request: Request) -> Response:
    return await _serve(request, routes.TGI_COMPAT.path, stream=None)


async def _serve(request: Request, route: str, stream: bool | None) -> Response:
    pool = services_of(request).pool
    settings = services_of(request).settings.http
    raw = schemas.decode_body(await read_body(request, settings.max_body_bytes))
    body = schemas.validate(raw, tgi.GenerateRequest)
    tgi.check_supported(body.parameters)
    model = body.model
    if model is None:
        await pool.wait_for_worker()
        models = pool.models()
        if not models:
            raise errors.NoWorker("No worker is serving a model.")
        model = models[0]
    as_list = stream is None and not body.stream
    streaming = body.stream if stream is None else stream
    completion = tgi.to_completion(body, model, streaming)
    checked = schemas.validate(completion, schemas.CompletionRequest)
    schemas.check_limits(checked, settings)
    builder = tgi.TgiBuilder(model, body, completion.get("seed"), as_list=as_list)
    call = Call(request, "completion", route, completion, checked, builder)
    return await call.serve(lambda limit: body.inputs[:limit])


# What this module answers (gateway.app wires every module's table).
ENDPOINTS: Endpoints = {
    (routes.TGI_GENERATE, "POST"): generate,
    (routes.TGI_GENERATE_STREAM, "POST"): generate_stream,
    (routes.TGI_COMPAT, "POST"): compat_generate,
}
