"""Shared by the deployment tests: load scripts under deploy/, settings names."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import msgspec

from shared import settings

ROOT = Path(__file__).resolve().parent.parent.parent
DEPLOY = ROOT / "deploy"


def load_module(path: Path) -> ModuleType:
    """Import a script under deploy/ (not a package) by its path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env_names(cls: type[msgspec.Struct]) -> set[str]:
    return {settings.env_name(name) for name, *_ in settings.fields(cls)}
