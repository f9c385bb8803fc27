"""The gateway's ASGI app: routes, the pool's lifetime, and the one error handler."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from gateway import background, batch, endpoints, errors, metrics, openapi, tenants, tracing
from gateway.api import (
    auth,
    direct,
    health,
    openai_routes,
    request_ids,
    tgi_routes,
    usage_routes,
    vllm_routes,
)
from gateway.api.request_ids import request_id_of
from gateway.api.services import ServedApp, Services
from gateway.batch import api as batch_api
from gateway.cache import merge_config, open_cache
from gateway.dispatch.models import Models
from gateway.dispatch.pool import Pool
from gateway.endpoints import render
from gateway.state import State
from gateway.tenants import budgets
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)

# Every route of the table (shared.routes) and the endpoint that answers it.
ENDPOINTS = endpoints.wire(
    health.ENDPOINTS,
    openai_routes.ENDPOINTS,
    tgi_routes.ENDPOINTS,
    vllm_routes.ENDPOINTS,
    usage_routes.ENDPOINTS,
    batch_api.ENDPOINTS,
)


def create_app_from_environment() -> ASGIApp:
    """The app with settings from ``LLMGATE_*`` variables (uvicorn's factory)."""
    from shared import settings
    from shared.logs import setup_logging

    gateway = settings.from_environment(GatewaySettings)
    # uvicorn's extra processes (--processes) start with no logging set up.
    if not logging.getLogger().handlers:
        setup_logging(gateway.observability.log_level, gateway.observability.log_format)
    return create_app(gateway)


def create_app(settings: GatewaySettings) -> ASGIApp:
    """The ASGI stack: request ids (:mod:`gateway.api.request_ids`), the API-key
    check (when keys are set), then the API's POST routes served directly
    (:mod:`gateway.api.direct`), then FastAPI."""
    tracing.setup(settings.observability.otlp_endpoint)
    keys = auth.KeyRing(settings.tenants)
    api = create_api(settings, keys)
    app = below_keys(api, keys)
    if len(keys):
        app = auth.ApiKeyMiddleware(app, keys=keys)
    return request_ids.RequestIds(app)


def below_keys(api: ServedApp, keys: auth.KeyRing) -> ASGIApp:
    """The app below the API-key check: the API's POST routes served directly
    (:mod:`gateway.api.direct`), then FastAPI; with keys, a key's rate-limit
    headers and its grant's end around them (``gateway.tenants``). The batch
    runner sends its lines in here."""
    app: ASGIApp = direct.DirectRoutes(api, ENDPOINTS)
    return tenants.LimitScope(app) if len(keys) else app


def create_api(settings: GatewaySettings, keys: auth.KeyRing | None = None) -> ServedApp:
    """The FastAPI app: every route (and the OpenAPI document), the services'
    lifetime (:class:`gateway.api.services.Services`), and the error handlers."""
    keyring = keys if keys is not None else auth.KeyRing(settings.tenants)

    @asynccontextmanager
    async def lifespan(app: ServedApp) -> AsyncIterator[None]:
        # Model names, aliases, auto, pools and tiers (--config).
        models = Models.from_file(settings.routing.config)
        pool = Pool(settings.link, settings.admission, settings.routing, models=models)
        await pool.start()
        limits = tenants.Limiter(settings.tenants.limits, timeout=settings.tenants.limits_timeout)
        await limits.start()
        if settings.admission.fair_share:
            limits.share_fairly(pool.admission.fair)
        # None when --cache is off; the pools file's `cache:` fills in the
        # settings that flags and environment left at their defaults.
        cache = open_cache(merge_config(settings.caching, models.config))
        # Files, batch jobs, stored responses: the store every replica shares
        # (gateway.state); it connects in the background and /ready waits for it.
        store = State(settings.store)
        store.start()
        # A key's budget with no count yet this period starts at its usage.
        limits.spending.spent_so_far = budgets.from_usage(
            store, lambda model: models.price(models.resolve(model, {}, ()))
        )
        # The runner sends its lines below the key check, as their owner's key.
        batches = batch.start(
            settings.batch,
            store,
            below_keys(app, keyring),
            pool.capacity,
            pool.interactive_since,
            keyring,
        )
        # Background responses, run below the key check as their owner's key.
        runner = background.start(
            settings.store, settings.routing, store, below_keys(app, keyring), keyring
        )
        app.services = Services(settings, pool, limits, cache, store, batches, keyring, runner)
        # What start-up built (FastAPI, pydantic, routes) lives as long as the
        # process: frozen, the cyclic collector stops walking it again every
        # few hundred requests.
        gc.freeze()
        # A request makes a few dozen containers and frees nearly all of them
        # by reference count: at the default threshold (700) the young
        # generation was still collected every few dozen requests under load,
        # for nothing (docs/benchmarks.md).
        gc.set_threshold(10_000, 10, 10)
        # The request path's counter and gauge moves, written out each second.
        flusher = asyncio.create_task(metrics.flush_every(1.0))
        try:
            yield
        finally:
            flusher.cancel()
            await runner.stop()
            await batches.stop()
            await store.stop()
            if cache is not None:
                await cache.close()
            await limits.stop()
            await pool.stop()
            metrics.flush()
            metrics.mark_process_dead(os.getpid())

    app = ServedApp(
        title="llmgate", summary="OpenAI-compatible gateway over vLLM workers", lifespan=lifespan
    )
    endpoints.declare(app, ENDPOINTS)  # every route of the table (shared.routes)
    openapi.install(app)
    app.add_exception_handler(errors.GatewayError, _gateway_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
    return app


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.GatewayError)
    return render(exc, request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route, wrong method) in the path's dialect:
    TGI's body on TGI's paths (with its HTTP status kept), OpenAI's elsewhere."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if exc.status_code == 404:
        return render(errors.NotFound(f"No route {request.method} {path}."), path)
    error = (
        errors.BadRequest(str(exc.detail))
        if exc.status_code < 500
        else errors.GatewayError(str(exc.detail))
    )
    response = render(error, path)
    response.status_code = exc.status_code
    for name, value in (exc.headers or {}).items():  # a 405's Allow
        response.headers[name] = value
    return response


async def _validation_error(_: Request, exc: Exception) -> Response:
    return render(errors.BadRequest(str(exc)))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception(
        "unhandled error on %s %s",
        request.method,
        request.url.path,
        extra={"request_id": request_id_of(request.scope)},
    )
    return render(errors.GatewayError("Internal error in the gateway."))
