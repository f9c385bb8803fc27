"""The pools config file (``--config FILE``, YAML): many models behind one URL.

One file drives ``llmgate serve`` (which workers to start, where, with which
engine flags), ``llmgate gateway`` (pools, aliases, ``auto`` rules, tiers),
the compose generator and the Helm chart. :func:`load` checks the whole file
before any process starts; a mistake is a :class:`ConfigError` naming the
file, the line and the field. The file only describes: routing by it is
``gateway.dispatch.models``'s, and its ``cache:`` section fills only the
cache settings left at their defaults (``gateway.cache.merge_config``).
The fields and a worked example (``examples/two-pools.yaml``) are in
docs/models.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import yaml

from shared.cache_settings import check_cache_settings

# Names clients use and metrics carry: no spaces, nothing odd.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
# CPU cores ("0", "0-3", "0,2,4") or GPU ids ("0", "0,1").
_DEVICES = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


class ConfigError(ValueError):
    """A config file that cannot be used; the message names file, line and field."""


class Price(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """US dollars per million tokens (what keys' dollar budgets are counted in)."""

    input: float
    output: float


class Pool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    # What clients ask for; the pool's name when empty.
    served_model_name: str = ""
    # A model directory or id; empty = the embedded model.
    model: str = ""
    workers: int = 1
    # One entry per worker: GPU ids on a GPU box, CPU cores on a CPU one;
    # empty = as `llmgate serve` would place them without a config.
    devices: list[str] = []
    # vLLM engine flags of this pool's workers.
    engine_args: list[str] = []
    tier: int = 1
    # Seconds a request may wait for this pool before a later tier that
    # serves its model takes it; None = never spill.
    spill_after: float | None = None
    # Model names this pool may serve in their place (spill-over only).
    substitute_for: list[str] = []
    # `llmgate gateway`: where this pool's workers listen (host:port or tcp://...).
    addresses: list[str] = []
    # What its tokens cost, for keys' dollar budgets; None = not priced.
    price: Price | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.name


class Rule(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # The model or alias a matching request goes to.
    use: str
    # Names the rule in metrics and logs; "rule-N" when empty.
    name: str = ""
    # Conditions; every one that is set must hold.
    prompt_tokens_over: int | None = None
    max_tokens_over: int | None = None
    has_response_format: bool | None = None
    has_tools: bool | None = None
    # Request headers that must have these values (names in any case).
    headers: dict[str, str] = {}


class Cascade(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Where a non-streaming request that took the default route goes when
    # the default model's answer is not good enough.
    escalate_to: str
    # The default model's answer is kept when its mean token logprob is at
    # least this (and it parses, if a JSON response_format was asked for).
    min_mean_logprob: float = -1.0


class Auto(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # The model name that routes by the rules.
    name: str = "auto"
    rules: list[Rule] = []
    # Where a request goes when no rule matches.
    default: str
    # Counts prompt tokens for `prompt_tokens_over`: a model directory or a
    # tokenizer.json; empty = the embedded model's tokenizer when present,
    # else an estimate of 4 characters a token.
    tokenizer: str = ""
    cascade: Cascade | None = None


class Cache(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # The gateway's response cache; each field stands in for a setting left at
    # its default (--cache, --cache-ttl, --cache-max-bytes, --cache-scope).
    # `memory` or redis://HOST:PORT/DB; empty = as --cache says.
    url: str = ""
    # Seconds an entry is kept; None = as --cache-ttl says.
    ttl: float | None = None
    # The memory backend's size in bytes; None = as --cache-max-bytes says.
    max_bytes: int | None = None
    # deterministic, greedy or all; None = as --cache-scope says.
    scope: str | None = None


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pools: list[Pool]
    aliases: dict[str, str] = {}
    auto: Auto | None = None
    cache: Cache | None = None

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)

    def served_models(self) -> list[str]:
        """Served model names, in the order the pools are declared, once each."""
        return list(dict.fromkeys(p.model_name for p in self.pools))


def load(path: str | Path) -> Config:
    """Read and check a config file; raises :class:`ConfigError` naming line and field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from None
    return parse(text, str(path))


def parse(text: str, source: str = "<config>") -> Config:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}{where}: not valid YAML: {problem}") from None
    if node is None:
        raise ConfigError(f"{source}: the config file is empty; it needs `pools:`")
    lines: dict[tuple[str | int, ...], int] = {}
    _record_lines(node, (), lines)
    data = yaml.SafeLoader(text).get_single_data()
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at `$")
        field = _path(where.rstrip("`")) if where else ()
        unknown = re.match(r"Object contains unknown field `(.+)`$", message)
        if unknown:
            field, message = (*field, unknown.group(1)), "no such field"
        raise _error(source, lines, field, message.replace("`", "")) from None
    _check(config, source, lines)
    return config


def _record_lines(
    node: yaml.Node, path: tuple[str | int, ...], lines: dict[tuple[str | int, ...], int]
) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            _record_lines(value, (*path, str(key.value)), lines)
            # A field's line is its key's (a block value starts on the next).
            lines[(*path, str(key.value))] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _record_lines(item, (*path, index), lines)


def _path(text: str) -> tuple[str | int, ...]:
    """msgspec's ``.pools[0].workers`` as ``("pools", 0, "workers")``."""
    out: list[str | int] = []
    for name, index, key in re.findall(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]|\[(.*?)\]", text):
        out.append(int(index) if index else name or key.strip("'\""))
    return tuple(out)


def _dotted(path: tuple[str | int, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _error(
    source: str,
    lines: dict[tuple[str | int, ...], int],
    path: tuple[str | int, ...],
    message: str,
) -> ConfigError:
    # The deepest part of the path the file has (a missing field: its parent).
    probe = path
    while probe and probe not in lines:
        probe = probe[:-1]
    line = lines.get(probe, 1)
    field = f" {_dotted(path)}:" if path else ""
    return ConfigError(f"{source}:{line}:{field} {message}")


def _check(config: Config, source: str, lines: dict[tuple[str | int, ...], int]) -> None:
    """What types alone do not say: names, references, counts."""

    def fail(path: tuple[str | int, ...], message: str) -> None:
        raise _error(source, lines, path, message)

    if not config.pools:
        fail(("pools",), "at least one pool is needed")
    pool_names: set[str] = set()
    for i, pool in enumerate(config.pools):
        at = ("pools", i)
        for field, value in (("name", pool.name), ("served_model_name", pool.served_model_name)):
            if value and not _NAME.match(value):
                fail((*at, field), f"{value!r} is not a usable name (letters, digits, ._:/@+-)")
        if pool.name in pool_names:
            fail((*at, "name"), f"pool {pool.name!r} is declared twice")
        pool_names.add(pool.name)
        if pool.workers < 1:
            fail((*at, "workers"), "a pool needs at least one worker")
        if pool.tier < 1:
            fail((*at, "tier"), "tiers count from 1")
        if pool.spill_after is not None and pool.spill_after < 0:
            fail((*at, "spill_after"), "must be 0 or more seconds")
        if pool.devices and len(pool.devices) != pool.workers:
            fail(
                (*at, "devices"),
                f"{len(pool.devices)} device entries for {pool.workers} workers; "
                "give one per worker, or none",
            )
        for j, devices in enumerate(pool.devices):
            if not _DEVICES.match(devices.replace(" ", "")):
                fail((*at, "devices", j), f"{devices!r} is not like '0', '0,1' or '0-3'")
        if any(a.startswith("--served-model-name") for a in pool.engine_args):
            fail((*at, "engine_args"), "set the pool's served_model_name, not --served-model-name")
        if any(a == "--model" or a.startswith("--model=") for a in pool.engine_args):
            fail((*at, "engine_args"), "set the pool's model, not --model")
        if pool.price is not None:
            for field in ("input", "output"):
                value = getattr(pool.price, field)
                if not 0 <= value < float("inf"):  # NaN too
                    fail((*at, "price", field), "must be 0 or more dollars per million tokens")
    served = set(config.served_models())
    for i, pool in enumerate(config.pools):
        for j, name in enumerate(pool.substitute_for):
            if name not in served:
                fail(("pools", i, "substitute_for", j), f"no pool serves {name!r}")
            if name == pool.model_name:
                fail(("pools", i, "substitute_for", j), "a pool cannot substitute for itself")
    known = set(served)
    for alias, target in config.aliases.items():
        if not _NAME.match(alias):
            fail(("aliases", alias), f"{alias!r} is not a usable name")
        if alias in served:
            fail(("aliases", alias), f"{alias!r} is already a served model's name")
        if target not in served:
            fail(("aliases", alias), f"{target!r} is not a served model name")
        known.add(alias)
    if config.auto is not None:
        auto = config.auto
        if auto.name in known:
            fail(("auto", "name"), f"{auto.name!r} is already a model or alias name")
        if not _NAME.match(auto.name):
            fail(("auto", "name"), f"{auto.name!r} is not a usable name")
        if auto.default not in known:
            fail(("auto", "default"), f"{auto.default!r} is not a served model or alias")
        for i, rule in enumerate(auto.rules):
            if rule.use not in known:
                fail(("auto", "rules", i, "use"), f"{rule.use!r} is not a served model or alias")
        if auto.cascade is not None and auto.cascade.escalate_to not in known:
            fail(
                ("auto", "cascade", "escalate_to"),
                f"{auto.cascade.escalate_to!r} is not a served model or alias",
            )
    if config.cache is not None:
        _check_cache(config.cache, fail)


def _check_cache(cache: Cache, fail: Callable[[tuple[str | int, ...], str], None]) -> None:
    # check_cache_settings speaks of flags ("--cache must be ..."): keep what follows.
    problem = check_cache_settings(cache.url, "deterministic")
    if problem:
        fail(("cache", "url"), problem.split(" ", 1)[1])
    problem = check_cache_settings("", cache.scope) if cache.scope is not None else None
    if problem:
        fail(("cache", "scope"), problem.split(" ", 1)[1])
    if cache.ttl is not None and not cache.ttl > 0:
        fail(("cache", "ttl"), "must be more than 0 seconds")
    if cache.max_bytes is not None and cache.max_bytes < 1:
        fail(("cache", "max_bytes"), "must be at least 1 byte")


def to_yaml(config: Config) -> str:
    """The config as YAML (for generated deploy files)."""
    data: Any = msgspec.to_builtins(config)
    return str(yaml.safe_dump(data, sort_keys=False))
