"""Settings structs as command lines and environments: the machinery ``shared.settings`` uses.

Each field of a msgspec settings struct becomes a flag ``--field-name`` and
an environment variable ``LLMGATE_FIELD_NAME``; precedence is flag, then
environment, then the default. The help text is the field's ``Meta``
description. A process that refuses its settings exits with
``SETTINGS_ERROR_STATUS`` (``refuse``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Collection
from typing import Annotated, Any, NoReturn, TypeVar, get_args, get_origin, get_type_hints

import msgspec

ENV_PREFIX = "LLMGATE_"
# The exit status of a process that refuses its settings: argparse's for a
# usage error, so that ``llmgate serve`` tells a refusal from a crash and
# stops instead of restarting the process (serve/supervisor.py).
SETTINGS_ERROR_STATUS = 2

S = TypeVar("S", bound=msgspec.Struct)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _base_type(annotation: Any) -> Any:
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _description(annotation: Any) -> str:
    for meta in get_args(annotation)[1:] if get_origin(annotation) is Annotated else ():
        if isinstance(meta, msgspec.Meta) and meta.description:
            return meta.description
    return ""


def _parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def fields(cls: type[msgspec.Struct]) -> list[tuple[str, type, Any, str]]:
    """(name, type, default, help) for every setting of ``cls``."""
    hints = get_type_hints(cls, include_extras=True)
    out = []
    for field in msgspec.structs.fields(cls):
        annotation = hints[field.name]
        out.append((field.name, _base_type(annotation), field.default, _description(annotation)))
    return out


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type[msgspec.Struct],
    *,
    title: str = "",
    description: str | None = None,
    skip: Collection[str] = (),
) -> None:
    """Add one flag per field of ``cls`` but those in ``skip``, in a help group
    named ``title``; defaults come from the environment first."""
    group = parser.add_argument_group(
        title or f"{cls.__name__} (flags or {ENV_PREFIX}* variables)", description
    )
    for name, kind, default, help_text in fields(cls):
        if name in skip:
            continue
        env = env_name(name)
        text = f"{help_text} [env {env}; default {default!r}]"
        if kind is bool:
            group.add_argument(
                _flag(name),
                dest=name,
                type=_parse_bool,
                nargs="?",
                const=True,
                default=argparse.SUPPRESS,
                help=text,
            )
        else:
            group.add_argument(
                _flag(name), dest=name, type=kind, default=argparse.SUPPRESS, help=text
            )


def given_flags(namespace: argparse.Namespace, names: Collection[str]) -> list[str]:
    """The flags among ``names`` given on the command line parsed into ``namespace``
    (``add_arguments`` leaves the others out), as ``--name=value`` for another process."""
    flags = []
    for name in names:
        if hasattr(namespace, name):
            value = getattr(namespace, name)
            shown = ("true" if value else "false") if isinstance(value, bool) else str(value)
            flags.append(f"{_flag(name)}={shown}")
    return flags


def refuse(message: str) -> NoReturn:
    """Print ``message`` on stderr and exit with ``SETTINGS_ERROR_STATUS``."""
    print(message, file=sys.stderr, flush=True)
    raise SettingsRefused(message)


class SettingsRefused(SystemExit):
    """A process refusing its settings (``refuse``): ``str()`` is the message."""

    def __init__(self, message: str) -> None:
        super().__init__(SETTINGS_ERROR_STATUS)
        self.message = message

    def __str__(self) -> str:
        return self.message


def to_environment(instance: msgspec.Struct) -> dict[str, str]:
    """``LLMGATE_*`` variables that reproduce ``instance`` (for child processes)."""
    out = {}
    for name, kind, _default, _help_text in fields(type(instance)):
        value = getattr(instance, name)
        out[env_name(name)] = ("1" if value else "0") if kind is bool else str(value)
    return out


def from_environment(cls: type[S]) -> S:
    """``cls`` from ``LLMGATE_*`` variables and defaults alone."""
    return from_namespace(cls, argparse.Namespace())


def from_namespace(cls: type[S], namespace: argparse.Namespace) -> S:
    """Build ``cls`` from parsed flags, falling back to ``LLMGATE_*`` env, then defaults."""
    values: dict[str, Any] = {}
    for name, kind, _default, _help_text in fields(cls):
        if hasattr(namespace, name):
            values[name] = getattr(namespace, name)
            continue
        raw = os.environ.get(env_name(name))
        if raw is None:
            continue
        try:
            values[name] = _parse_bool(raw) if kind is bool else kind(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            refuse(f"invalid {env_name(name)}={raw!r}: {exc}")
    return cls(**values)
