"""The gateway's API behind its API-key check, with a YAML keys file and a connected
state store (SQLite), and no pool: for the routes that answer from the store alone
(files, batches, usage, stored responses) or refuse before running anything."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from gateway.api import auth, request_ids
from gateway.app import below_keys, create_api
from gateway.background import Notices
from gateway.state import State
from gateway.tenants import Limiter
from shared import api_keys
from shared.settings import GatewaySettings

# The store's first connect is a hang guard, not a clock.
WITHIN = 60


class Keyed:
    """The app, its store and a key per name (``ops`` is an admin)."""

    def __init__(self, tmp_path: Path, names: tuple[str, ...], **settings: Any) -> None:
        self.path = tmp_path / "keys.yaml"
        self.keys = {name: api_keys.add(self.path, name) for name in names}
        self.keys["ops"] = api_keys.add(self.path, "ops", admin=True)
        settings = GatewaySettings.of(
            api_keys_file=str(self.path), state_dir=str(tmp_path / "state"), **settings
        )
        self.store = State(settings.store)
        self.ring = auth.KeyRing(settings.tenants)
        self.api = create_api(settings, self.ring)
        # The services the routes under test read: no pool, no limits, no cache,
        # and what creating or cancelling a batch wakes (no runner here).
        batches = SimpleNamespace(
            runner=SimpleNamespace(wake=lambda: None), max_file_bytes=settings.batch.max_file_bytes
        )
        # No background runner either: a background response stays queued.
        notices = Notices()
        background = SimpleNamespace(
            wake=lambda: None,
            stop_one=lambda response_id: None,
            notices=notices,
            changed=notices.tell,
        )
        self.api.services = SimpleNamespace(  # type: ignore[assignment]
            settings=settings,
            store=self.store,
            batches=batches,
            keys=self.ring,
            limits=Limiter(),
            background=background,
        )
        # As gateway.app stacks it: request ids, the key check, then the
        # direct routes and FastAPI.
        self.app = request_ids.RequestIds(
            auth.ApiKeyMiddleware(below_keys(self.api, self.ring), self.ring)
        )

    def id_of(self, name: str) -> str:
        [entry] = [e for e in api_keys.load(self.path) if e.name == name]
        return entry.id

    def add_again(self, name: str) -> None:
        """Revoke ``name`` and add it again, with a new secret (the ring sees it at once)."""
        api_keys.revoke(self.path, name)
        self.keys[name] = api_keys.add(self.path, name)

    def client(self, name: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app),
            base_url="http://gw",
            headers={"Authorization": f"Bearer {self.keys[name]}"},
        )


@asynccontextmanager
async def keyed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    names: tuple[str, ...] = ("team-a", "team-b"),
    **settings: Any,
) -> AsyncIterator[Keyed]:
    """The app with the keys ``names`` and ``ops`` (an admin), and ``settings``."""
    monkeypatch.setattr(auth, "RELOAD_SECONDS", 0.0)
    gateway = Keyed(tmp_path, names, **settings)
    await asyncio.wait_for(gateway.store.connect(), WITHIN)
    try:
        yield gateway
    finally:
        gateway.store.db.close()
