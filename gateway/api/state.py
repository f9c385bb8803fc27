"""The app's state, as a request's code reads it: the pool, the settings, the caches and stores.

Set once by ``gateway.app`` (the settings when the app is built, the pool and
the cache when it starts).
"""

from __future__ import annotations

from starlette.requests import Request

from gateway.cache import ResponseCache
from gateway.pool import Pool
from gateway.state import Ledger, State
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


def store_of(request: Request) -> State:
    """The state store: files, batches, stored responses (``gateway.state``)."""
    store: State = request.app.state.store
    return store


def ledger_of(request: Request) -> Ledger | None:
    """Where the request's usage is counted (``gateway.state.ledger``); None in
    an app without a state store (a unit test's)."""
    store: State | None = getattr(request.app.state, "store", None)
    return store.ledger if store is not None else None
