"""The app's services, made once when it starts: what a request's code reaches for.

:class:`Services` is built in the app's lifespan (``gateway.app``), kept on
the app (:class:`ServedApp`) and read through :func:`services_of`: the pool,
the keys' limits, the response cache, the state store and its usage ledger,
the batch runner's front, the keys.
Nothing a request needs lives in a module global or as an untyped attribute of
the app.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from starlette.requests import Request

from gateway.api.auth import KeyRing
from gateway.background import Runner
from gateway.batch import Batches
from gateway.cache import ResponseCache
from gateway.dispatch.pool import Pool
from gateway.state import Ledger, State
from gateway.tenants import Limiter
from shared.settings import GatewaySettings


@dataclass(frozen=True, slots=True)
class Services:
    settings: GatewaySettings
    pool: Pool
    # API keys' limits: per process, or shared in Redis (--limits).
    limits: Limiter
    # None with --cache off.
    cache: ResponseCache | None
    # Files, batch jobs, stored responses, usage: what every replica shares.
    store: State
    batches: Batches
    keys: KeyRing
    # Runs background responses (gateway.background).
    background: Runner

    @property
    def ledger(self) -> Ledger:
        """Where requests' usage is counted (``gateway.state.ledger``)."""
        return self.store.ledger


class ServedApp(FastAPI):
    """The FastAPI app, holding its services once its lifespan has made them
    (a plain attribute: ``app.state``'s lookup is slow, and read on every request)."""

    services: Services


def services_of(request: Request) -> Services:
    app: ServedApp = request.scope["app"]
    return app.services
