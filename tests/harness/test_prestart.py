"""Module systems started one module ahead (tests/harness/prestart.py), on stand-in modules."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.harness import prestart


class Modules:
    """Stand-in test modules with a system each; what was started and stopped."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.failing: set[str] = set()

    def module(self, name: str, fixture: str | None = "system") -> ModuleType:
        module = ModuleType(f"tests.integration.{name}")
        if fixture is not None:
            module.SYSTEM_FIXTURE = fixture  # type: ignore[attr-defined]

        def launch_system(directory: Path) -> prestart.Launched:
            if name in self.failing:
                raise RuntimeError(f"{name} did not start")
            self.started.append(name)
            return prestart.Launched(
                f"{name} in {directory.name}", lambda: self.stopped.append(name)
            )

        module.launch_system = launch_system  # type: ignore[attr-defined]
        return module


class Factory:
    def __init__(self, base: Path) -> None:
        self.base = base

    def mktemp(self, name: str) -> Path:
        path = self.base / name
        path.mkdir()
        return path


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch) -> Modules:
    # The session's own plan (this run's real modules) stays as it was.
    monkeypatch.setattr(prestart, "_order", [])
    monkeypatch.setattr(prestart, "_ahead", {})
    monkeypatch.setattr(prestart, "_taken", set())
    monkeypatch.setattr(prestart, "_ahead_enabled", True)
    return Modules()


def item(module: ModuleType, *fixtures: str) -> Any:
    return SimpleNamespace(module=module, fixturenames=list(fixtures))


def request(module: ModuleType, factory: Factory) -> Any:
    return SimpleNamespace(module=module, config=SimpleNamespace(_tmp_path_factory=factory))


def test_each_module_takes_its_system_while_the_next_one_starts(
    modules: Modules, tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    first, second, third = (modules.module(n) for n in ("first", "second", "third"))
    items = [item(first, "system"), item(first, "system"), item(second, "system")]
    prestart.plan([*items, item(third, "base_url", "system")], factory)  # type: ignore[arg-type]
    assert modules.started == ["first"]  # at collection: only the first is ahead

    assert prestart.take(request(first, factory)) == "first in first"
    assert modules.started == ["first", "second"]
    assert prestart.take(request(second, factory)) == "second in second"
    assert modules.started == ["first", "second", "third"]
    assert prestart.take(request(third, factory)) == "third in third"
    assert modules.started == ["first", "second", "third"]  # none after the last
    prestart.stop_untaken()
    assert modules.stopped == []  # each was taken: their fixtures stop them


def test_modules_whose_collected_tests_do_not_use_the_system_are_not_planned(
    modules: Modules, tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    unused, plain, used = (
        modules.module("unused"),
        modules.module("plain", None),
        modules.module("used"),
    )
    prestart.plan(
        [item(unused, "base_url"), item(plain, "system"), item(used, "system")],  # type: ignore[list-item]
        factory,  # type: ignore[arg-type]
    )
    assert modules.started == ["used"]


def test_a_system_nobody_took_is_stopped_at_the_end(modules: Modules, tmp_path: Path) -> None:
    factory = Factory(tmp_path)
    first, second = modules.module("first"), modules.module("second")
    prestart.plan([item(first, "system"), item(second, "system")], factory)  # type: ignore[arg-type]
    prestart.take(request(first, factory))
    prestart.stop_untaken()  # the run stopped before the second module
    assert modules.stopped == ["second"]


def test_a_system_that_fails_to_start_fails_its_own_module_not_the_one_before(
    modules: Modules, tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    first, second = modules.module("first"), modules.module("second")
    modules.failing.add("second")
    prestart.plan([item(first, "system"), item(second, "system")], factory)  # type: ignore[arg-type]
    assert prestart.take(request(first, factory)) == "first in first"
    with pytest.raises(RuntimeError, match="second did not start"):
        prestart.take(request(second, factory))


def test_a_module_that_was_not_planned_starts_its_system_when_it_asks(
    modules: Modules, tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    alone = modules.module("alone")
    prestart.plan([], factory)  # type: ignore[arg-type]
    assert modules.started == []
    assert prestart.take(request(alone, factory)) == "alone in alone"


def test_the_first_system_can_wait_for_the_sessions(modules: Modules, tmp_path: Path) -> None:
    factory = Factory(tmp_path)
    first, second = modules.module("first"), modules.module("second")
    items = [item(first, "system"), item(second, "system")]
    prestart.plan(items, factory, start_first=False)  # type: ignore[arg-type]
    assert modules.started == []
    prestart.start_first_system(factory)  # type: ignore[arg-type]
    prestart.start_first_system(factory)  # type: ignore[arg-type]
    assert modules.started == ["first"]  # once
    prestart.take(request(first, factory))
    prestart.take(request(second, factory))
    prestart.start_first_system(factory)  # type: ignore[arg-type]
    assert modules.started == ["first", "second"]  # not again once taken


def test_without_ahead_each_system_starts_only_when_its_module_takes_it(
    modules: Modules, tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    first, second = modules.module("first"), modules.module("second")
    items = [item(first, "system"), item(second, "system")]
    prestart.plan(items, factory, ahead=False)  # type: ignore[arg-type]
    prestart.start_first_system(factory)  # type: ignore[arg-type]
    assert modules.started == []
    assert prestart.take(request(first, factory)) == "first in first"
    assert modules.started == ["first"]  # the second not yet: one at a time
    assert prestart.take(request(second, factory)) == "second in second"
    assert modules.started == ["first", "second"]
