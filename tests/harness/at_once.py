"""Run one step in several threads released at the same moment (replicas starting
together, claims racing), as the tests of races need."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def at_once(count: int, run: Callable[[int], T]) -> list[T | BaseException]:
    """``run(i)`` for each i in range(count), in threads released together by a
    barrier; each one's result, or the exception it raised (for the test to
    surface: a failure must not leave the others' results, e.g. started
    servers, unaccounted for)."""
    start = threading.Barrier(count)
    results: list[T | BaseException] = [RuntimeError("not run")] * count

    def go(i: int) -> None:
        start.wait()
        try:
            results[i] = run(i)
        except BaseException as exc:  # handed to the caller
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def raised(results: list[T | BaseException]) -> list[BaseException]:
    return [r for r in results if isinstance(r, BaseException)]
