"""The app's state, as a request's code reads it: the pool, the settings, the response cache.

Set once by ``gateway.app`` (the settings when the app is built, the pool and
the cache when it starts).
"""

from __future__ import annotations

from starlette.requests import Request

from gateway.cache import ResponseCache
from gateway.pool import Pool
from shared.settings import GatewaySettings


def pool_of(request: Request) -> Pool:
    pool: Pool = request.app.state.pool
    return pool


def settings_of(request: Request) -> GatewaySettings:
    settings: GatewaySettings = request.app.state.settings
    return settings


def cache_of(request: Request) -> ResponseCache | None:
    """The response cache (None with ``--cache`` off)."""
    cache: ResponseCache | None = request.app.state.cache
    return cache
