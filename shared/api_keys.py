"""Named API keys with limits: the ``--api-keys-file`` formats, ``llmgate keys add|list|revoke``.

A keys file is a plain list (one key per line, ``#`` comments) or YAML with
a list of :class:`KeyEntry` under ``keys:`` (docs/tenants.md). Only a key's
SHA-256 is kept, in memory and in what ``llmgate keys add`` writes, so the
file need not hold secrets. A key's ``id`` owns what it makes (files,
batches, stored responses, usage); its ``name`` is what people read. The
two differ on purpose: an id not given follows the secret
(:func:`derived_id`), so a name revoked and added again with a new secret
is a new key that owns nothing of the old one's. This module reads and
writes keys; checking them is ``gateway.api.auth``'s, limiting them
``gateway.tenants``'.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml
from msgspec.structs import force_setattr

from shared.protocol import BANDS

# A key's band (one of ``protocol.BANDS``); ``priority:`` is its former name.
Band = Literal["interactive", "standard", "batch"]
KEY_PREFIX = "sk-llmgate-"
# The name usage and metrics give requests when no keys are configured
# (reserved: no key may be named so).
ANONYMOUS = "-"


class Budget(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a key may spend over a UTC day and a calendar month; 0 is no budget."""

    tokens_per_day: int = 0
    tokens_per_month: int = 0
    usd_per_day: float = 0.0
    usd_per_month: float = 0.0


BUDGET_FIELDS = ("tokens_per_day", "tokens_per_month", "usd_per_day", "usd_per_month")


class KeyEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One key: who it is, and what it may do. A limit of 0 is no limit."""

    name: str
    key_sha256: str
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent: int = 0
    # None: every model; else the served names and aliases it may use.
    models: tuple[str, ...] | None = None
    # Its requests' priority band: a request may ask for a lower one.
    band: Band = "interactive"
    admin: bool = False
    # Spend over a day and a month (gateway.tenants.budgets); None: no budget.
    budget: Budget | None = None
    # What owns the key's files, batches, responses and usage; "" = derived
    # from the hash (``derived_id``), filled in on construction.
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            force_setattr(self, "id", derived_id(self.key_sha256))

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


def derived_id(key_sha256: str) -> str:
    """The id of a key whose entry names none: it follows the secret, not the name."""
    return "key_" + key_sha256[:16]


class _FileEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    id: str = ""
    key: str = ""
    key_sha256: str = ""
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent: int = 0
    models: list[str] | None = None
    band: Band | None = None
    priority: Band | None = None  # the former name of ``band``
    admin: bool = False
    budget: Budget | None = None


class _File(msgspec.Struct, forbid_unknown_fields=True):
    keys: list[_FileEntry]


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode("ascii")).hexdigest()


def check_key(key: str) -> None:
    if not key or not key.isascii() or not key.isprintable() or " " in key:
        # Said without the key itself: this message may reach a log.
        raise ValueError("an API key must be printable ASCII without spaces")


def plain_entry(key: str) -> KeyEntry:
    """A key given as is (``--api-keys``, a plain list): no limits."""
    check_key(key)
    digest = sha256_hex(key)
    return KeyEntry(name=f"key-{digest[:8]}", key_sha256=digest)


def parse(text: str, source: str) -> list[KeyEntry]:
    """The keys of a keys file's ``text`` (YAML with ``keys:``, or a plain list).

    ValueError naming ``source`` and the entry for anything wrong; a file
    that holds no key is an error, not "no authentication": an empty secret
    mount must not open the gateway.
    """
    loaded: Any = None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:
        pass  # a plain list need not be YAML
    if isinstance(loaded, dict) and "keys" in loaded:
        entries = _parse_yaml(loaded, source)
    else:
        lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        entries = [plain_entry(line) for line in lines if line]
    if not entries:
        raise ValueError(f"{source} holds no key")
    _check_unique(entries, source)
    return entries


def _parse_yaml(loaded: dict[str, Any], source: str) -> list[KeyEntry]:
    try:
        parsed = msgspec.convert(loaded, _File)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{source}: {exc}") from None
    entries = []
    for i, item in enumerate(parsed.keys):
        where = f"{source}: keys[{i}] ({item.name or 'no name'})"
        if not item.name:
            raise ValueError(f"{where}: `name` is required")
        if item.name == ANONYMOUS:
            raise ValueError(f"{where}: {ANONYMOUS!r} is reserved (requests with no key)")
        if item.id == ANONYMOUS:
            raise ValueError(f"{where}: the id {ANONYMOUS!r} is reserved (requests with no key)")
        if item.id and (not item.id.isascii() or not item.id.isprintable() or " " in item.id):
            raise ValueError(f"{where}: `id` must be printable ASCII without spaces")
        if bool(item.key) == bool(item.key_sha256):
            raise ValueError(f"{where}: give exactly one of `key` and `key_sha256`")
        digest = item.key_sha256.lower()
        if item.key:
            try:
                check_key(item.key)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            digest = sha256_hex(item.key)
        elif len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{where}: `key_sha256` must be 64 hex digits")
        for field in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            if getattr(item, field) < 0:
                raise ValueError(f"{where}: `{field}` must be 0 (no limit) or more")
        if item.band and item.priority and item.band != item.priority:
            raise ValueError(f"{where}: `band` and `priority` (its former name) differ")
        budget = item.budget
        for field in BUDGET_FIELDS if budget is not None else ():
            value = getattr(budget, field)
            if not value >= 0 or math.isinf(value):  # NaN and infinity too
                raise ValueError(f"{where}: `budget.{field}` must be 0 (no budget) or more")
        if budget is not None and not any(getattr(budget, f) for f in BUDGET_FIELDS):
            budget = None
        entries.append(
            KeyEntry(
                name=item.name,
                key_sha256=digest,
                requests_per_minute=item.requests_per_minute,
                tokens_per_minute=item.tokens_per_minute,
                max_concurrent=item.max_concurrent,
                models=tuple(item.models) if item.models is not None else None,
                band=item.band or item.priority or "interactive",
                admin=item.admin,
                budget=budget,
                id=item.id,
            )
        )
    return entries


def _check_unique(entries: list[KeyEntry], source: str) -> None:
    check_unique(entries, f"{source}: ", "given twice")


def check_unique(entries: list[KeyEntry], where: str, twice: str) -> None:
    """ValueError (``where``, then what, then ``twice``) for two entries with one
    name, one id or one key: each would be taken for the other."""
    names: set[str] = set()
    ids: set[str] = set()
    digests: set[str] = set()
    for entry in entries:
        if entry.name in names:
            raise ValueError(f"{where}the name {entry.name!r} is {twice}")
        if entry.id in ids:
            raise ValueError(f"{where}the id {entry.id!r} (of {entry.name!r}) is {twice}")
        if entry.key_sha256 in digests:
            raise ValueError(f"{where}the key of {entry.name!r} is {twice}")
        names.add(entry.name)
        ids.add(entry.id)
        digests.add(entry.key_sha256)


def load(path: str | Path) -> list[KeyEntry]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --api-keys-file {path}: {exc}") from exc
    return parse(text, f"--api-keys-file {path}")


# -- llmgate keys add / list / revoke ---------------------------------------------


def _read_entries(path: Path) -> list[dict[str, Any]]:
    """The file's YAML entries as written (a missing file: none)."""
    if not path.exists():
        return []
    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(loaded, dict) or not isinstance(loaded.get("keys"), list):
        raise ValueError(f"{path} is not a YAML keys file (a list under `keys:`)")
    parse(path.read_text(encoding="utf-8"), str(path))  # refuse to edit a broken file
    return list(loaded["keys"])


def _write_entries(path: Path, entries: list[dict[str, Any]]) -> None:
    """Replace the file at once (a gateway re-reading it never sees half a file)."""
    text = yaml.safe_dump({"keys": entries}, sort_keys=False)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.chmod(partial, 0o600)
    os.replace(partial, path)


def add(path: Path, name: str, **limits: Any) -> str:
    """Add a key named ``name`` to the file; the new key (shown once, stored hashed)."""
    entries = _read_entries(path)
    if any(entry.get("name") == name for entry in entries):
        raise ValueError(f"{path} already has a key named {name!r}")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    digest = sha256_hex(key)
    # The id written out: what the key makes stays its own even if the
    # way ids are derived changes, and a name added again gets a new one.
    entry: dict[str, Any] = {"name": name, "id": derived_id(digest), "key_sha256": digest}
    entry.update({k: v for k, v in limits.items() if v not in (None, 0, False)})
    entries.append(entry)
    parse(yaml.safe_dump({"keys": entries}), str(path))  # what is written must load
    _write_entries(path, entries)
    return key


def revoke(path: Path, name: str) -> None:
    entries = _read_entries(path)
    kept = [entry for entry in entries if entry.get("name") != name]
    if len(kept) == len(entries):
        raise ValueError(f"{path} has no key named {name!r}")
    if not kept:
        raise ValueError(f"{name!r} is the last key in {path}: a keys file must hold one")
    _write_entries(path, kept)


def describe(path: Path, spent: dict[tuple[str, str], float] | None = None) -> list[str]:
    """One line per key: its name, what it may do and its id (never the key or its hash);
    with ``spent`` (by key id and budget field, as a gateway counts it), each budget's spend."""
    rows = []
    for entry in load(path):
        limits = [
            f"{label} {value}"
            for label, value in (
                ("rpm", entry.requests_per_minute),
                ("tpm", entry.tokens_per_minute),
                ("concurrent", entry.max_concurrent),
            )
            if value
        ]
        budget = entry.budget
        limits += [
            f"{field.replace('_', ' ')} {getattr(budget, field):g}{_spent(spent, entry.id, field)}"
            for field in BUDGET_FIELDS
            if budget is not None and getattr(budget, field)
        ]
        models = ",".join(entry.models) if entry.models is not None else "all models"
        extra = [entry.band, *(["admin"] if entry.admin else [])]
        rows.append(
            f"{entry.name}\t{', '.join(limits) or 'no limits'}\t{models}\t{' '.join(extra)}"
            f"\tid {entry.id}"
        )
    return rows


def _spent(spent: dict[tuple[str, str], float] | None, key_id: str, field: str) -> str:
    if not spent or (key_id, field) not in spent:
        return ""
    return f" (spent {spent[key_id, field]:g})"


# Where ``llmgate keys list --gateway`` finds the admin key (not a flag: a
# flag's value shows in the process list).
ADMIN_KEY_ENV = "LLMGATE_ADMIN_KEY"


def spent_by_gateway(url: str) -> dict[tuple[str, str], float]:
    """Every budget's spend this period, by key id and budget field, as the gateway
    at ``url`` counts it (``GET /v1/usage``: every key's, to an admin key)."""
    import httpx

    key = os.environ.get(ADMIN_KEY_ENV, "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        answer = httpx.get(f"{url.rstrip('/')}/v1/usage", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise ValueError(f"{url} does not answer: {exc}") from None
    if answer.status_code != 200:
        raise ValueError(
            f"{url}/v1/usage answered {answer.status_code}: set ${ADMIN_KEY_ENV} to an admin key"
        )
    return {(b["key_id"], b["budget"]): b["spent"] for b in answer.json().get("budgets", [])}


def add_commands(commands: Any) -> None:
    """``add``, ``list`` and ``revoke`` under ``llmgate keys``."""
    add_cmd = commands.add_parser("add", help="add an API key to a YAML keys file; prints it once")
    add_cmd.add_argument("name", help="the key's name (usage, metrics, logs)")
    add_cmd.add_argument("--file", required=True, type=Path, help="the --api-keys-file (YAML)")
    add_cmd.add_argument("--requests-per-minute", type=int, default=0)
    add_cmd.add_argument("--tokens-per-minute", type=int, default=0)
    add_cmd.add_argument("--max-concurrent", type=int, default=0)
    add_cmd.add_argument("--models", default="", help="comma-separated served names or aliases")
    add_cmd.add_argument(
        "--band",
        "--priority",
        choices=BANDS,
        default="interactive",
        help="its requests' priority band (a request may ask for a lower one)",
    )
    add_cmd.add_argument("--admin", action="store_true", help="sees every key's usage and state")
    for field in BUDGET_FIELDS:
        kind = float if field.startswith("usd") else int
        add_cmd.add_argument(
            "--" + field.replace("_", "-"),
            type=kind,
            default=0,
            help="budget over a UTC day or a calendar month (dollars at the pools file's prices)",
        )
    list_cmd = commands.add_parser("list", help="the keys of a keys file, without secrets")
    list_cmd.add_argument("--file", required=True, type=Path)
    list_cmd.add_argument(
        "--gateway",
        default="",
        help="a gateway's URL: each budget's spend as it counts it (GET /v1/usage), "
        f"with the admin key in ${ADMIN_KEY_ENV}",
    )
    revoke_cmd = commands.add_parser("revoke", help="remove a key from a YAML keys file")
    revoke_cmd.add_argument("name")
    revoke_cmd.add_argument("--file", required=True, type=Path)


def run(args: argparse.Namespace) -> bool:
    """Run ``add``, ``list`` or ``revoke``; False if ``args`` is another command."""
    try:
        if args.command == "add":
            models = [m.strip() for m in args.models.split(",") if m.strip()]
            key = add(
                args.file,
                args.name,
                requests_per_minute=args.requests_per_minute,
                tokens_per_minute=args.tokens_per_minute,
                max_concurrent=args.max_concurrent,
                models=models or None,
                band=None if args.band == "interactive" else args.band,
                admin=args.admin,
                budget={f: getattr(args, f) for f in BUDGET_FIELDS if getattr(args, f)} or None,
            )
            print(key)
            print(f"added {args.name!r} to {args.file}; the key is shown only now", file=sys.stderr)
        elif args.command == "list":
            spent = spent_by_gateway(args.gateway) if args.gateway else None
            print("\n".join(describe(args.file, spent)))
        elif args.command == "revoke":
            revoke(args.file, args.name)
            print(f"revoked {args.name!r} in {args.file}", file=sys.stderr)
        else:
            return False
    except ValueError as exc:
        print(f"llmgate keys: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return True
