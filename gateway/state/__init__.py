"""The gateway's shared state: uploaded files, batch jobs and their lines, stored responses
and background ones, usage per key.

One database for all of it (``gateway.state.db``): SQLite in ``--state-dir``,
shared by one host's gateway processes, or PostgreSQL (``--state-db``), shared by
every replica, so any replica serves any request. :class:`State` connects and
migrates in the background (``/ready`` waits for its first try), answers 503
(``errors.StateUnavailable``) from :meth:`State.call` while the store is down,
deletes what expired (:meth:`State.reap`) and flushes the usage counted in memory
(``ledger``). Rows have an ``owner``: the id of the API key that made them
(``KeyEntry.id``, never its name; NULL with no keys). Methods that read take a
``viewer``: a key id sees its own rows only, None sees every row.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from gateway import errors
from gateway.state.background import Background
from gateway.state.batches import Batches
from gateway.state.db import Database, Unavailable
from gateway.state.files import Files
from gateway.state.ledger import Ledger
from gateway.state.response_store import Responses
from gateway.state.usage import Usage
from shared.settings import StoreSettings, resolve_state_dir

__all__ = [
    "Background",
    "Batches",
    "Database",
    "Files",
    "Ledger",
    "Responses",
    "State",
    "Unavailable",
    "Usage",
]

log = logging.getLogger(__name__)

DAY = 24 * 3600
# Between tries to reach the store at start, and between deletions of what expired.
CONNECT_PAUSE_SECONDS = 2.0
REAP_SECONDS = 600.0

T = TypeVar("T")


class State:
    def __init__(self, settings: StoreSettings) -> None:
        # A bad --state-db URL is a configuration error: raised (ValueError).
        self.db = Database(settings.state_db, resolve_state_dir(settings.state_dir))
        self.shared = bool(settings.state_db)
        self.files = Files(self.db)
        self.batches = Batches(self.db, self.files, settings.batch_output_days * DAY)
        self.responses = Responses(self.db, settings.responses_days * DAY)
        self.background = Background(
            self.db, self.responses, settings.background_events_hours * 3600
        )
        self.ready = asyncio.Event()
        # Set once the first try to reach the store has ended, however it did:
        # a local SQLite store is opened by then (/ready waits for it).
        self.tried = asyncio.Event()
        self.usage = Usage(self.db)
        self.ledger = Ledger(self.usage, self.ready)
        self._tasks: list[asyncio.Task[None]] = []
        self.problem = "the state store has not answered yet"

    async def connect(self) -> None:
        """Wait for the database and bring its schema up to date."""
        warned = False
        while True:
            try:
                await asyncio.to_thread(self.db.migrate)
            except (Unavailable, OSError) as exc:
                self.problem = f"the state store {self.db.where} does not answer ({exc})"
                self.tried.set()
                if not warned:
                    log.warning("%s; trying again every %.0fs", self.problem, CONNECT_PAUSE_SECONDS)
                    warned = True
                await asyncio.sleep(CONNECT_PAUSE_SECONDS)
                continue
            log.info("state store: %s", self.db.where)
            self.problem = ""
            self.ready.set()
            self.tried.set()
            return

    async def call(self, method: Callable[..., T], *args: object) -> T:
        """``method(*args)`` in a thread; 503 if the store is not up (yet, or now)."""
        if not self.ready.is_set():
            raise errors.StateUnavailable(f"Files, batches and stored responses: {self.problem}.")
        try:
            return await asyncio.to_thread(method, *args)
        except Unavailable as exc:
            raise errors.StateUnavailable(
                f"The state store {self.db.where} does not answer: {exc}."
            ) from exc

    async def reap(self) -> None:
        """Delete expired files and responses now and then (every replica may: idempotent)."""
        await self.ready.wait()
        while True:
            try:
                files = await asyncio.to_thread(self.files.expire)
                responses = await asyncio.to_thread(self.responses.expire)
                await asyncio.to_thread(self.background.expire)
                await asyncio.to_thread(self.usage.expire)
                if files or responses:
                    log.info(
                        "state store: deleted %d expired files, %d responses", files, responses
                    )
            except Unavailable as exc:
                log.warning("state store: could not delete what expired (%s)", exc)
            except Exception:
                # Any other error of the store (e.g. a read-only standby after a
                # failover): said, and tried again; the reaper must not die of it.
                log.exception("state store: deleting what expired failed")
            await asyncio.sleep(REAP_SECONDS)

    def start(self) -> None:
        """Connect (and migrate), then reap and flush usage, in the background
        (call inside the running loop)."""
        self._tasks = [
            asyncio.create_task(self.connect(), name="state store connect"),
            asyncio.create_task(self.reap(), name="state store reaper"),
        ]
        self.ledger.start()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ledger.stop()
        self.db.close()


def check_url(url: str) -> str:
    """Why ``--state-db`` cannot be used, or ``""``."""
    try:
        Database.check_url(url)
    except ValueError as exc:
        return str(exc)
    return ""
