"""shared/config.py: the pools file, and errors that name the line and the field."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from shared import config

ROOT = Path(__file__).resolve().parents[2]

GOOD = """\
pools:
  - name: small
    served_model_name: smollm2-bf16
    devices: ["0"]
  - name: large
    tier: 2
    substitute_for: [smollm2-bf16]
aliases:
  fast: smollm2-bf16
auto:
  rules:
    - {use: large, max_tokens_over: 100}
  default: fast
"""


def error(text: str) -> str:
    with pytest.raises(config.ConfigError) as caught:
        config.parse(text, "pools.yaml")
    return str(caught.value)


def test_a_good_file_reads_with_its_defaults() -> None:
    parsed = config.parse(GOOD)
    assert parsed.served_models() == ["smollm2-bf16", "large"]
    assert parsed.pool("large").model_name == "large"  # its name when not given
    assert parsed.pool("small").workers == 1 and parsed.pool("small").tier == 1
    assert parsed.pool("small").spill_after is None  # never spills unless asked
    assert parsed.auto is not None and parsed.auto.name == "auto"


def test_the_example_in_the_repository_is_valid() -> None:
    parsed = config.load(ROOT / "examples" / "two-pools.yaml")
    assert [p.name for p in parsed.pools] == ["small", "large"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pools:\n  - name: a\n    workers: two\n", "pools.yaml:3: pools[0].workers: Expected int"),
        ("pools:\n  - name: a\n    colour: red\n", "pools.yaml:3: pools[0].colour: no such field"),
        (
            "pools:\n  - served_model_name: a\n",
            "pools.yaml:2: pools[0]: Object missing required field name",
        ),
        ("pools: []\n", "pools.yaml:1: pools: at least one pool is needed"),
        (
            "pools:\n  - name: a\n  - name: a\n",
            "pools.yaml:3: pools[1].name: pool 'a' is declared twice",
        ),
        ("pools:\n  - name: a\n    tier: 0\n", "pools.yaml:3: pools[0].tier: tiers count from 1"),
        (
            "pools:\n  - name: a\n    workers: 2\n    devices: ['0']\n",
            "pools.yaml:4: pools[0].devices: 1 device entries for 2 workers",
        ),
        (
            "pools:\n  - name: a\n    devices: [cpu0]\n",
            "pools.yaml:3: pools[0].devices[0]: 'cpu0' is not like",
        ),
        (
            "pools:\n  - name: a\n    substitute_for: [b]\n",
            "pools.yaml:3: pools[0].substitute_for[0]: no pool serves 'b'",
        ),
        (
            "pools:\n  - name: a\naliases:\n  x: b\n",
            "pools.yaml:4: aliases.x: 'b' is not a served model name",
        ),
        (
            "pools:\n  - name: a\naliases:\n  a: a\n",
            "pools.yaml:4: aliases.a: 'a' is already a served model's name",
        ),
        (
            "pools:\n  - name: a\nauto:\n  default: nope\n",
            "pools.yaml:4: auto.default: 'nope' is not a served model or alias",
        ),
        (
            "pools:\n  - name: a\nauto:\n  default: a\n  rules:\n    - {use: b}\n",
            "pools.yaml:6: auto.rules[0].use: 'b' is not",
        ),
        (
            "pools:\n  - name: a\n    engine_args: [--model, x]\n",
            "pools.yaml:3: pools[0].engine_args: set the pool's model",
        ),
        ("pools:\n  - name: a b\n", "pools.yaml:2: pools[0].name: 'a b' is not a usable name"),
        (
            "pools:\n  - name: a\ncache:\n  url: memcached://m\n",
            "pools.yaml:4: cache.url: must be empty, `memory` or a redis:// URL",
        ),
        (
            "pools:\n  - name: a\ncache: {url: memory, scope: sometimes}\n",
            "pools.yaml:3: cache.scope: must be one of deterministic, greedy, all",
        ),
        (
            "pools:\n  - name: a\ncache:\n  url: memory\n  ttl: 0\n",
            "pools.yaml:5: cache.ttl: must be more than 0 seconds",
        ),
        (
            "pools:\n  - name: a\ncache:\n  max_bytes: 1.5\n",
            "pools.yaml:4: cache.max_bytes: Expected int",
        ),
        (
            "pools:\n  - name: a\ncache:\n  uri: memory\n",
            "pools.yaml:4: cache.uri: no such field",
        ),
        ("pools:\n  - name: a\n   bad: [\n", "pools.yaml:3: not valid YAML"),
        ("", "pools.yaml: the config file is empty"),
    ],
)
def test_a_bad_file_gets_one_message_with_line_and_field(text: str, expected: str) -> None:
    assert error(text).startswith(expected)


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="cannot read the config file"):
        config.load(tmp_path / "absent.yaml")


CACHED = """\
pools:
  - name: a
cache:
  url: redis://redis:6379/0
  ttl: 600
  max_bytes: 1000000
  scope: greedy
"""


def test_a_cache_section_reads_and_is_optional() -> None:
    assert config.parse(GOOD).cache is None
    cache = config.parse(CACHED).cache
    assert cache == config.Cache(
        url="redis://redis:6379/0", ttl=600, max_bytes=1000000, scope="greedy"
    )
    partial = config.parse("pools:\n  - name: a\ncache: {url: memory}\n").cache
    assert partial is not None and partial.ttl is None and partial.scope is None
    assert config.parse(config.to_yaml(config.parse(CACHED))) == config.parse(CACHED)


def test_flags_and_environment_win_over_the_files_cache_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.cache import merge_config
    from shared import settings
    from shared.settings import CacheSettings, GatewaySettings

    parsed = config.parse(CACHED)
    for name in ("CACHE", "CACHE_TTL", "CACHE_MAX_BYTES", "CACHE_SCOPE"):
        monkeypatch.delenv(f"LLMGATE_{name}", raising=False)
    # Left at their defaults: the file's values.
    merged = merge_config(CacheSettings(), parsed)
    assert (merged.cache, merged.cache_ttl, merged.cache_max_bytes, merged.cache_scope) == (
        "redis://redis:6379/0",
        600,
        1000000,
        "greedy",
    )
    # A flag and a variable win; what neither gives still comes from the file.
    monkeypatch.setenv("LLMGATE_CACHE_TTL", "30")
    namespace = settings.from_namespace(GatewaySettings, argparse.Namespace(cache="memory")).caching
    merged = merge_config(namespace, parsed)
    assert (merged.cache, merged.cache_ttl, merged.cache_max_bytes, merged.cache_scope) == (
        "memory",
        30,
        1000000,
        "greedy",
    )
    # No file, or no section: the settings as they are.
    assert merge_config(namespace, None) is namespace
    assert merge_config(namespace, config.parse(GOOD)) is namespace
