"""Batch jobs: OpenAI's Files and Batches API, and the runner that works through the jobs.

``jsonl`` checks an input file; files, jobs and every line's result are kept
in the shared state store (``gateway.state``); ``api`` serves ``/v1/files``
and ``/v1/batches``; ``runner`` takes jobs to their end through the
gateway's own request path, below interactive requests, with every other
replica; ``cli`` is ``llmgate batch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp

from gateway.api.auth import KeyRing
from gateway.batch.runner import Runner
from gateway.state import State
from shared.settings import BatchSettings


@dataclass
class Batches:
    """What the batch routes need: the state store, the runner and the upload limit."""

    store: State
    runner: Runner
    max_file_bytes: int

    async def stop(self) -> None:
        await self.runner.stop()


def start(
    settings: BatchSettings,
    store: State,
    app: ASGIApp,
    capacity: Callable[[], int],
    interactive_since: Callable[[], float],
    keys: KeyRing | None = None,
) -> Batches:
    """Start the runner (call inside the running loop); it waits for the store.

    ``app`` is the gateway's app below the API-key check, the runner's way in;
    ``capacity`` the healthy workers' slots, ``interactive_since`` the seconds
    since the last interactive request (the runner's cap); ``keys`` the
    configured API keys, to run each job's lines as its owner's key (by id).
    """
    runner = Runner(
        store,
        app,
        capacity,
        interactive_since,
        settings,
        keys,
    )
    runner.start()
    return Batches(store, runner, settings.max_file_bytes)
