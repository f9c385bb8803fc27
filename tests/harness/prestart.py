"""Engine systems of single test modules, started one module ahead.

Some modules start engines of their own (CURVE keys, the launcher's default
layout, vLLM's own server for parity, the two pools, tracing, two workers).
An engine takes 30-45 s to start, most of it importing and loading rather
than computing, so each start used to add that much to the suite. Now a
module's system starts when the module before it (of those with one) takes
its own, and comes up while that module's tests run; the first starts once
the session's system is ready (at once when no test uses that one), so the
two do not slow each other's start, on which every test waits. At most one
system is ahead at a time: each holds gigabytes. A session run with
``--no-prestart`` (make test's session of the modules with systems of their
own, beside the integration session's engines) starts each when its module
takes it, and so holds one at a time.

A module takes part with two names:

* ``SYSTEM_FIXTURE``: the fixture that takes the system (only the modules
  whose collected tests use that fixture are planned);
* ``launch_system(directory) -> Launched``: start the processes and return
  at once (the fixture waits for them to be ready).

and its fixture gets the launched value with ``take(request)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest


@dataclass
class Launched:
    """A started system, and how to stop it if no test gets to take it."""

    value: Any
    stop: Callable[[], None]


@dataclass
class _Failed:
    error: BaseException


# The modules with a system, in the order their tests run.
_order: list[ModuleType] = []
# Systems started ahead and not yet taken, by module name.
_ahead: dict[str, Launched | _Failed] = {}
# Modules that took theirs.
_taken: set[str] = set()
# False: no system starts before its module takes it (``plan``).
_ahead_enabled = True


def _uses_system(item: pytest.Item) -> ModuleType | None:
    module = getattr(item, "module", None)
    fixture = getattr(module, "SYSTEM_FIXTURE", None)
    if fixture is None or fixture not in getattr(item, "fixturenames", ()):
        return None
    return module


def plan(
    items: Sequence[pytest.Item],
    factory: pytest.TempPathFactory,
    start_first: bool = True,
    ahead: bool = True,
) -> None:
    """Note which modules have a system, in run order; start the first one's
    now, or (``start_first`` false) when ``start_first_system`` is called;
    with ``ahead`` false, none before its module takes it."""
    global _ahead_enabled
    _ahead_enabled = ahead
    for item in items:
        module = _uses_system(item)
        if module is not None and module not in _order:
            _order.append(module)
    if start_first:
        start_first_system(factory)


def start_first_system(factory: pytest.TempPathFactory) -> None:
    """Start the first planned module's system, unless it started already."""
    if _ahead_enabled and _order and _order[0].__name__ not in _ahead and not _taken:
        _launch_ahead(_order[0], factory)


def _launch(module: ModuleType, factory: pytest.TempPathFactory) -> Launched:
    directory = factory.mktemp(module.__name__.rsplit(".", 1)[-1])
    launched: Launched = module.launch_system(directory)
    return launched


def _launch_ahead(module: ModuleType, factory: pytest.TempPathFactory) -> None:
    try:
        _ahead[module.__name__] = _launch(module, factory)
    except Exception as error:  # raised where that module takes it, not here
        _ahead[module.__name__] = _Failed(error)


def take(request: pytest.FixtureRequest) -> Any:
    """The requesting module's system (started ahead, or now when it was not
    planned), after starting the next planned module's."""
    module = request.module
    factory: pytest.TempPathFactory = request.config._tmp_path_factory  # type: ignore[attr-defined]
    launched = _ahead.pop(module.__name__, None)
    _taken.add(module.__name__)
    if _ahead_enabled and module in _order:
        following = _order[_order.index(module) + 1 :]
        if following and following[0].__name__ not in _ahead:
            _launch_ahead(following[0], factory)
    if launched is None:
        launched = _launch(module, factory)
    if isinstance(launched, _Failed):
        raise launched.error
    return launched.value


def stop_untaken() -> None:
    """At the session's end: the systems no test took (the run stopped first)."""
    for launched in _ahead.values():
        if isinstance(launched, Launched):
            launched.stop()
    _ahead.clear()
