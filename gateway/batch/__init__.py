"""Batch jobs: OpenAI's Files and Batches API, and the runner that works through the jobs.

``jsonl`` checks an input file; ``store`` keeps files, jobs and every line's
result in the state directory (SQLite); ``api`` serves ``/v1/files`` and
``/v1/batches``; ``runner`` takes each job to its end through the gateway's
own request path, below interactive requests; ``cli`` is ``llmgate batch``.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp

from gateway.batch.runner import Runner
from gateway.batch.store import Store
from shared.settings import GatewaySettings, resolve_state_dir

log = logging.getLogger(__name__)


@dataclass
class Batches:
    """What the batch routes need: the store and runner, or why there are none."""

    store: Store | None
    runner: Runner | None
    max_file_bytes: int
    problem: str = ""

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        if self.store is not None:
            self.store.close()


def start(
    settings: GatewaySettings,
    app: ASGIApp,
    capacity: Callable[[], int],
    interactive_since: Callable[[], float],
) -> Batches:
    """Open the state directory and start the runner (call inside the running loop).

    ``app`` is the gateway's app below the API-key check, the runner's way in;
    ``capacity`` the healthy workers' slots, ``interactive_since`` the seconds
    since the last interactive request (the runner's cap). A state directory that cannot be
    used leaves the gateway serving, with the batch routes answering 503 and
    the reason logged.
    """
    directory = resolve_state_dir(settings.state_dir)
    try:
        store = Store(directory)
    except (OSError, sqlite3.Error) as exc:
        problem = f"the state directory {directory} cannot be used ({exc})"
        log.warning("files and batches off: %s", problem)
        return Batches(None, None, settings.max_file_bytes, problem)
    runner = Runner(store, app, capacity, interactive_since, settings.batch_max_inflight)
    runner.start()
    return Batches(store, runner, settings.max_file_bytes)
