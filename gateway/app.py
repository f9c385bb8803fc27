"""The gateway's ASGI app: routes, the pool's lifetime, and the one error handler."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from gateway import errors, metrics, openapi, sse, tgi
from gateway.api import auth, health, openai
from gateway.api import tgi as tgi_routes
from gateway.pool import Pool
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)


def create_app_from_environment() -> FastAPI:
    """The app with settings from ``LLMGATE_*`` variables (uvicorn's factory)."""
    from shared import settings

    return create_app(settings.from_environment(GatewaySettings))


def create_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = Pool(settings)
        await pool.start()
        app.state.pool = pool
        try:
            yield
        finally:
            await pool.stop()
            metrics.mark_process_dead(os.getpid())

    app = FastAPI(
        title="llmgate", summary="OpenAI-compatible gateway over vLLM workers", lifespan=lifespan
    )
    app.include_router(openai.router)
    app.include_router(tgi_routes.router)
    openapi.install(app)
    app.include_router(health.router)
    api_keys = auth.load_api_keys(settings)
    if api_keys:
        app.add_middleware(
            auth.ApiKeyMiddleware, keys=api_keys, protect_metrics=settings.protect_metrics
        )
    app.add_exception_handler(errors.GatewayError, _gateway_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
    return app


def _render(error: errors.GatewayError, request: Request | None = None) -> Response:
    if request is not None and request.url.path in tgi.PATHS:
        # TGI's clients read TGI's error body.
        return Response(
            sse.encode(tgi.error_body(error)),
            status_code=tgi.error_status(error),
            headers=error.headers(),
            media_type="application/json",
        )
    return Response(
        error.json(),
        status_code=error.status,
        headers=error.headers(),
        media_type="application/json",
    )


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.GatewayError)
    return _render(exc, request)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _render(errors.NotFound(f"No route {request.method} {request.url.path}."))
    error = (
        errors.BadRequest(str(exc.detail))
        if exc.status_code < 500
        else errors.GatewayError(str(exc.detail))
    )
    response = _render(error)
    response.status_code = exc.status_code
    return response


async def _validation_error(_: Request, exc: Exception) -> Response:
    return _render(errors.BadRequest(str(exc)))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _render(errors.GatewayError("Internal error in the gateway."))
