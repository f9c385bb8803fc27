"""Waiting on a state that has no event to await: look at it until it holds,
and fail, naming what was awaited, after a bound that only guards a hang (the
machine is shared and slow; a test process may get a small share of a core)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 60) -> None:
    """Until ``predicate()`` holds, looked at every 0.1 s; fails naming ``what``
    after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.1)


async def until(condition: Callable[[], object], within: float = 30) -> None:
    """Until ``condition()`` holds, looked at every 10 ms; fails after ``within`` seconds."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 (a state with no event to wait on)
            await asyncio.sleep(0.01)
