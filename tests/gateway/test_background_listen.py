"""gateway/background/listen.py: on PostgreSQL, events another replica stores wake this
process's readers at once (LISTEN/NOTIFY), and again after the store restarts; a
runner tells the store of each write (gateway/background/runner.py)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest_asyncio

from gateway.api.responses import Record
from gateway.background.follow import LISTENING_POLL_SECONDS, Notices
from gateway.background.listen import listen
from gateway.background.runner import Runner
from gateway.state import State
from gateway.state.background import Background
from gateway.state.db import POSTGRES_CONNECT_ARGS, Database
from gateway.state.response_store import Responses
from shared.settings import StoreSettings
from tests.gateway.test_background_runner import RESPONSE, events, streaming
from tests.harness.postgres_server import PostgresServer
from tests.harness.waiting import until

# Far longer than the test's hang guard: a reader woken before it was woken by a notice.
NEVER = 3600.0
_names = itertools.count()


@pytest_asyncio.fixture(loop_scope="function")
async def listening(
    postgres_server: PostgresServer, tmp_path: Path
) -> AsyncIterator[tuple[Notices, Background]]:
    """This process's notices, listening; and the store as another replica writes it."""
    url = postgres_server.create_database(f"listen_{next(_names)}")
    writer = Database(url, tmp_path / "state")
    writer.migrate()
    notices = Notices()
    # This process's own store, as the runner's: only its address is used here.
    own = Database(url, tmp_path / "own")
    task = asyncio.create_task(listen(own.conninfo(), POSTGRES_CONNECT_ARGS, notices))
    try:
        await until(lambda: notices.listening, within=60)
        yield notices, Background(writer, Responses(writer, 3600), retention_seconds=3600)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        writer.close()
        own.close()


async def stored_wakes(notices: Notices, store: Background, seq: int) -> bool:
    """Whether a reader waiting on resp_1 wakes once another replica stores event ``seq``
    and tells the store, as its runner does."""
    reader = asyncio.create_task(notices.wait("resp_1", NEVER))
    await until(lambda: notices._waiting.get("resp_1"))
    assert await asyncio.to_thread(store.append, "runner-a", "resp_1", seq, [b"{}"])
    await asyncio.to_thread(store.notify, ["resp_1"])
    async with asyncio.timeout(60):  # a hang guard: the reader waits NEVER without it
        return await reader


async def test_another_replicas_event_wakes_a_reader_at_once(
    listening: tuple[Notices, Background],
) -> None:
    notices, store = listening
    record = msgspec.json.encode({"response": {"status": "queued"}, "items": []})
    store.create("resp_1", "key_a", b"{}", record)
    assert store.claim("runner-a", 10, lease=3600)
    assert await stored_wakes(notices, store, 0)
    # While notices come, a reader looks on its own only as a safety net.
    assert notices.poll_seconds == LISTENING_POLL_SECONDS


async def test_after_the_store_restarts_it_listens_again_and_readers_look_again(
    listening: tuple[Notices, Background], postgres_server: PostgresServer
) -> None:
    notices, store = listening
    record = msgspec.json.encode({"response": {"status": "queued"}, "items": []})
    store.create("resp_1", "key_a", b"{}", record)
    assert store.claim("runner-a", 10, lease=3600)
    await asyncio.to_thread(postgres_server.stop)
    await until(lambda: not notices.listening, within=60)
    # Readers look every POLL_SECONDS while nothing would wake them.
    assert notices.poll_seconds < LISTENING_POLL_SECONDS
    waiting = asyncio.create_task(notices.wait("resp_1", NEVER))
    await until(lambda: notices._waiting.get("resp_1"))
    await asyncio.to_thread(postgres_server.start)
    # Back: what was stored meanwhile went unnoticed, so every reader looks.
    async with asyncio.timeout(60):
        assert await waiting
    assert notices.listening
    assert await stored_wakes(notices, store, 0)


async def test_a_runners_writes_wake_another_replicas_readers(
    listening: tuple[Notices, Background], postgres_server: PostgresServer, tmp_path: Path
) -> None:
    notices, store = listening
    record = msgspec.json.encode(Record(RESPONSE, []))
    store.create("resp_1", None, b'{"input":"hi"}', record)
    state = State(StoreSettings(state_db=store.db.conninfo(), state_dir=str(tmp_path / "r")))
    await state.connect()
    runner = Runner(state, streaming(events(["One", " two"])), lease_seconds=60, max_runs=0)
    # Watched before the runner starts: only the store's notices tell this
    # process's Notices anything (its runner is another replica's).
    with notices.watch("resp_1") as told:
        runner.start()
        try:
            async with asyncio.timeout(60):  # a hang guard: the run ends at once
                while store.status("resp_1", None) != "completed":
                    await told.wait()
                    told.clear()
        finally:
            await runner.stop()
            await state.stop()
