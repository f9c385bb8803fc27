"""Settings structs as command lines and environments: the machinery ``shared.settings`` uses.

A settings struct (``Settings``) holds leaf settings and groups, one level
deep: a group is a field that is a settings struct itself, one per component.
Each leaf becomes a flag ``--field-name`` and an environment variable
``LLMGATE_FIELD_NAME`` whatever group it sits in (leaf names are unique);
precedence is flag, then environment, then the default. The help text is the
field's ``Meta`` description. A process that refuses its settings exits with
``SETTINGS_ERROR_STATUS`` (``refuse``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Collection, Mapping
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


class Settings(msgspec.Struct, kw_only=True):
    """A settings struct: leaf settings, and groups (fields that are settings
    structs themselves, one per component). Every leaf's name is unique across
    the groups: it is the flag and the variable, wherever the group sits."""

    @classmethod
    def of(cls: type[S], **values: Any) -> S:
        """``cls`` from leaf settings by name, each put in its group (``build``)."""
        return build(cls, values)


def _hints(cls: type[msgspec.Struct]) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def _is_group(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, msgspec.Struct)


def groups(cls: type[msgspec.Struct]) -> list[tuple[str, type[msgspec.Struct]]]:
    """(attribute, struct) of ``cls`` itself and each of its groups: "" for
    ``cls``'s own leaves, then the groups in the order they are declared."""
    hints = _hints(cls)
    nested = [
        (field.name, _base_type(hints[field.name]))
        for field in msgspec.structs.fields(cls)
        if _is_group(_base_type(hints[field.name]))
    ]
    return [("", cls), *nested]


def own_fields(cls: type[msgspec.Struct]) -> list[tuple[str, type, Any, str]]:
    """(name, type, default, help) for the leaf settings of ``cls``, not its groups'."""
    hints = _hints(cls)
    out = []
    for field in msgspec.structs.fields(cls):
        annotation = hints[field.name]
        if not _is_group(_base_type(annotation)):
            out.append(
                (field.name, _base_type(annotation), field.default, _description(annotation))
            )
    return out


def fields(cls: type[msgspec.Struct]) -> list[tuple[str, type, Any, str]]:
    """(name, type, default, help) for every leaf setting of ``cls``, its groups' too."""
    return [leaf for _, group in groups(cls) for leaf in own_fields(group)]


def flatten(instance: msgspec.Struct) -> dict[str, Any]:
    """Every leaf setting of ``instance`` by name, its groups' too."""
    values = {name: getattr(instance, name) for name, *_ in own_fields(type(instance))}
    for attribute, _ in groups(type(instance))[1:]:
        values.update(flatten(getattr(instance, attribute)))
    return values


def build(cls: type[S], values: Mapping[str, Any]) -> S:
    """``cls`` from leaf settings by name (the others at their defaults), each
    put in its group; a name that is no leaf of ``cls`` is a TypeError."""
    left = dict(values)
    own = {name: left.pop(name) for name, *_ in own_fields(cls) if name in left}
    for attribute, group in groups(cls)[1:]:
        names = {name for name, *_ in fields(group)}
        own[attribute] = build(group, {n: left.pop(n) for n in names & left.keys()})
    if left:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(sorted(left))}")
    return cls(**own)


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
    for attribute, group_cls in groups(cls):
        leaves = [leaf for leaf in own_fields(group_cls) if leaf[0] not in skip]
        if leaves:
            heading = title or f"{cls.__name__} (flags or {ENV_PREFIX}* variables)"
            if attribute:
                heading = f"{heading}: {attribute}"
            # The description goes with the first group shown.
            group = parser.add_argument_group(heading, description)
            description = None
            _add_leaves(group, leaves)


def _add_leaves(group: argparse._ArgumentGroup, leaves: list[tuple[str, type, Any, str]]) -> None:
    for name, kind, default, help_text in leaves:
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
    return {
        env_name(name): ("1" if value else "0") if isinstance(value, bool) else str(value)
        for name, value in flatten(instance).items()
    }


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
    return build(cls, values)
