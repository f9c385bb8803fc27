"""/ready and the state store: a gateway says it is ready only once a file
uploaded at that moment would be taken."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

from gateway.api.health import ready
from gateway.state import State
from shared.settings import StoreSettings

# The guard on waiting for the store's first try: it only stops a hang.
WITHIN = 60


async def answer(store: State) -> tuple[int, dict[str, object]]:
    """/ready's status and body with one healthy worker and ``store``."""
    pool = SimpleNamespace(healthy_workers=lambda: ["worker-0"])
    services = SimpleNamespace(pool=pool, store=store)
    request = SimpleNamespace(scope={"app": SimpleNamespace(services=services)})
    response = await ready(request)  # type: ignore[arg-type]
    return response.status_code, json.loads(bytes(response.body))


async def test_a_local_store_not_yet_opened_keeps_the_gateway_not_ready(tmp_path: Path) -> None:
    store = State(StoreSettings(state_dir=str(tmp_path)))
    status, body = await answer(store)
    assert status == 503 and body["ready"] is False
    assert body["state_store"] == "the state store has not answered yet"

    await asyncio.wait_for(store.connect(), WITHIN)
    assert await answer(store) == (200, {"ready": True, "healthy_workers": 1})
    store.db.close()


async def test_a_local_store_that_failed_its_first_try_leaves_the_gateway_ready(
    tmp_path: Path,
) -> None:
    """Only the routes that need state answer 503 then; completions go on."""
    store = State(StoreSettings(state_dir=str(tmp_path)))

    def broken() -> list[str]:
        raise OSError("disk I/O error")

    store.db.migrate = broken  # type: ignore[method-assign]
    connecting = asyncio.create_task(store.connect())
    try:
        await asyncio.wait_for(store.tried.wait(), WITHIN)
        status, body = await answer(store)
        assert (status, body["ready"]) == (200, True)
        assert not store.ready.is_set()
    finally:
        connecting.cancel()
        store.db.close()
