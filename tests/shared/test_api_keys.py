"""shared/api_keys.py: the keys file's two formats, its errors, ``llmgate keys add|list|revoke``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shared import api_keys, curve_keys
from shared.api_keys import sha256_hex

YAML = """
keys:
  - name: team-a
    key: sk-team-a
    requests_per_minute: 60
    tokens_per_minute: 1000
    max_concurrent: 2
    models: [smollm2, chat]
  - name: nightly
    key_sha256: {digest}
    priority: batch
  - name: ops
    key: sk-ops
    admin: true
"""


def test_a_yaml_file_gives_names_limits_models_priority_and_admin() -> None:
    entries = api_keys.parse(YAML.format(digest=sha256_hex("sk-nightly")), "keys.yaml")
    team, nightly, ops = entries
    assert team.name == "team-a" and team.key_sha256 == sha256_hex("sk-team-a")
    assert (team.requests_per_minute, team.tokens_per_minute, team.max_concurrent) == (60, 1000, 2)
    assert team.allows("chat") and not team.allows("other")
    assert nightly.key_sha256 == sha256_hex("sk-nightly") and nightly.band == "batch"
    assert nightly.allows("anything") and nightly.requests_per_minute == 0  # no limit
    assert ops.admin and not team.admin


def test_a_plain_list_still_works_and_is_named_by_hash() -> None:
    [entry] = api_keys.parse("# ops\nsk-plain  # rotated\n", "keys")
    assert entry.key_sha256 == sha256_hex("sk-plain") and entry.name.startswith("key-")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys:\n  - name: a\n", "exactly one of `key` and `key_sha256`"),
        ("keys:\n  - name: a\n    key: k\n    key_sha256: '" + "0" * 64 + "'\n", "exactly one"),
        ("keys:\n  - name: a\n    key_sha256: " + "1" * 64 + "\n", "Expected `str`, got `int`"),
        ("keys:\n  - name: a\n    key_sha256: abc\n", "64 hex digits"),
        ("keys:\n  - name: a\n    key: k\n    requests_per_minute: -1\n", "0 \\(no limit\\)"),
        ("keys:\n  - name: a\n    key: k\n    priority: urgent\n", "priority"),
        (
            "keys:\n  - name: a\n    key: k\n    band: standard\n    priority: batch\n",
            "former name",
        ),
        ("keys:\n  - name: a\n    key: k\n    colour: red\n", "colour"),
        ("keys:\n  - name: a\n    key: k\n  - name: a\n    key: j\n", "given twice"),
        ("keys:\n  - name: a\n    key: k\n  - name: b\n    key: k\n", "given twice"),
        ("keys: []\n", "holds no key"),
    ],
)
def test_a_bad_entry_is_refused_naming_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        api_keys.parse(text, "keys.yaml")


def test_a_secret_is_never_in_an_error() -> None:
    with pytest.raises(ValueError) as raised:
        api_keys.parse("keys:\n  - name: a\n    key: 'secret value'\n", "keys.yaml")
    assert "secret" not in str(raised.value)


def test_add_prints_a_key_once_and_stores_only_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.yaml"
    curve_keys.main(["add", "team-a", "--file", str(path), "--requests-per-minute", "60"])
    curve_keys.main(["add", "ops", "--file", str(path), "--admin", "--models", "a, b"])
    first, second = [line for line in capsys.readouterr().out.splitlines() if line]
    assert first.startswith("sk-llmgate-") and first != second
    text = path.read_text()
    assert first not in text and sha256_hex(first) in text
    assert (path.stat().st_mode & 0o777) == 0o600
    team, ops = api_keys.load(path)
    assert team.requests_per_minute == 60 and ops.admin and ops.models == ("a", "b")
    curve_keys.main(["list", "--file", str(path)])
    listed = capsys.readouterr().out
    assert "team-a\trpm 60" in listed and "ops\tno limits\ta,b\tinteractive admin" in listed
    assert sha256_hex(first) not in listed


def test_revoke_removes_a_key_but_never_the_last(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    api_keys.add(path, "a")
    api_keys.add(path, "b")
    with pytest.raises(ValueError, match="already has a key named 'a'"):
        api_keys.add(path, "a")
    api_keys.revoke(path, "a")
    assert [e.name for e in api_keys.load(path)] == ["b"]
    with pytest.raises(ValueError, match="no key named 'a'"):
        api_keys.revoke(path, "a")
    with pytest.raises(ValueError, match="last key"):
        api_keys.revoke(path, "b")
    with pytest.raises(SystemExit) as exited:
        curve_keys.main(["revoke", "nobody", "--file", str(path)])
    assert exited.value.code == 2


def test_add_refuses_to_edit_a_plain_list(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-plain\n")
    with pytest.raises(ValueError, match="not a YAML keys file"):
        api_keys.add(path, "a")
    assert yaml.safe_load(path.read_text()) == "sk-plain"


def test_no_key_may_take_the_name_of_requests_without_one() -> None:
    with pytest.raises(ValueError, match="reserved"):
        api_keys.parse(f"keys:\n  - name: '{api_keys.ANONYMOUS}'\n    key: sk-abc\n", "k.yaml")


# -- ids: what owns a key's files, batches, responses and usage -------------------


def test_a_key_has_a_stable_id_given_in_the_file_or_derived_from_its_hash() -> None:
    text = (
        "keys:\n"
        "  - name: team-a\n    id: team-a-2024\n    key: sk-team-a\n"
        "  - name: team-b\n    key: sk-team-b\n"
    )
    given, derived = api_keys.parse(text, "keys.yaml")
    assert given.id == "team-a-2024"
    assert derived.id == "key_" + sha256_hex("sk-team-b")[:16]
    [plain] = api_keys.parse("sk-plain\n", "keys")
    assert plain.id == "key_" + sha256_hex("sk-plain")[:16]


def test_a_name_added_again_gets_a_new_id_written_into_the_file(tmp_path: Path) -> None:
    """The hole: owners were names, so a name revoked and added again with a new
    secret took over everything the old key made."""
    path = tmp_path / "keys.yaml"
    api_keys.add(path, "spare")
    first = api_keys.add(path, "team-a")
    [written] = [e for e in yaml.safe_load(path.read_text())["keys"] if e["name"] == "team-a"]
    assert written["id"] == "key_" + sha256_hex(first)[:16]
    old_id = api_keys.load(path)[1].id
    api_keys.revoke(path, "team-a")
    api_keys.add(path, "team-a")
    new_id = api_keys.load(path)[1].id
    assert old_id == written["id"] and new_id != old_id


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys:\n  - {name: a, id: x, key: k}\n  - {name: b, id: x, key: j}\n", "id 'x'"),
        ("keys:\n  - {name: a, id: '-', key: k}\n", "reserved"),
        ("keys:\n  - {name: a, id: 'two words', key: k}\n", "`id`"),
    ],
)
def test_an_id_given_twice_or_unusable_is_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        api_keys.parse(text, "keys.yaml")


def test_list_shows_each_keys_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.yaml"
    key = api_keys.add(path, "team-a")
    curve_keys.main(["list", "--file", str(path)])
    assert f"\tid key_{sha256_hex(key)[:16]}" in capsys.readouterr().out


def test_a_keys_band_is_one_of_the_protocols_bands() -> None:
    """The keys file's type and the wire's order are one list, never two."""
    from typing import get_args

    from shared import api_keys, protocol

    assert get_args(api_keys.Band) == protocol.BANDS
