"""What each API key used, per model and UTC day: the ``usage`` table.

Gateway processes do not write a row per request: each adds up its requests
in memory (``gateway.state.ledger``) and hands them here every few seconds
as one *flush*, added in one transaction. Adding is an upsert that adds to
the row in the database (``INSERT ... ON CONFLICT DO UPDATE SET n = n +
excluded.n``, on SQLite and PostgreSQL alike), so processes and replicas
flushing at once never lose each other's counts. Each flush has an id,
recorded in ``usage_flushes`` in the same transaction: a flush tried again
because its commit's answer was lost is added once, never twice.

A row is a key's by its id (``KeyEntry.id``): a name revoked and added
again with a new secret starts from nothing. It shows the key's name, as
it was when usage was last added (``key``; the id is ``key_id``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import date
from typing import Any

import msgspec
from sqlalchemy import delete, func, select
from sqlalchemy.dialects import postgresql, sqlite

from gateway.state.db import Database
from gateway.state.tables import usage, usage_flushes

# How long a flush's id is kept: far longer than any process keeps trying it.
FLUSH_IDS_SECONDS = 24 * 3600
COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")


@dataclass
class Counts:
    """What one key used of one model on one day (the ``usage`` row's counters)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, other: Counts) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens


# (key id, model, UTC day as YYYY-MM-DD)
Row = tuple[str, str, str]


class Usage:
    def __init__(self, db: Database) -> None:
        self.db = db

    def add(
        self, flush_id: str, rows: Mapping[Row, Counts], names: Mapping[str, str] | None = None
    ) -> bool:
        """Add ``rows`` to the table in one transaction, unless the flush
        ``flush_id`` was added already; whether it was added now. ``names``:
        each key id's name to show (absent: the id)."""
        dialect = postgresql if self.db.postgres else sqlite
        mark = (
            dialect.insert(usage_flushes)
            .on_conflict_do_nothing(index_elements=["id"])
            .returning(usage_flushes.c.id)
        )
        upsert = dialect.insert(usage)
        upsert = upsert.on_conflict_do_update(
            index_elements=["key", "model", "day"],
            set_={
                "key_name": upsert.excluded.key_name,
                **{name: usage.c[name] + upsert.excluded[name] for name in COUNTS},
            },
        )
        names = names or {}
        values = [
            {"key": key, "key_name": names.get(key, key), "model": model, "day": day} | vars(counts)
            for (key, model, day), counts in sorted(rows.items())  # one lock order
        ]
        with self.db.write() as db:
            # On PostgreSQL a second try of the same flush waits here for the first.
            if db.execute(mark.values(id=flush_id, at=int(time.time()))).first() is None:
                return False
            if values:
                db.execute(upsert, values)
            return True

    def rows(
        self,
        key: str | None,
        model: str | None,
        start: date | None,
        end: date | None,
        name: str | None = None,
    ) -> list[dict[str, Any]]:
        """The rows matching the filters (None: any): ``key`` a key id, ``name``
        the name a row shows; by day, key and model. Each row's ``key`` is the
        name it shows, ``key_id`` the id it is owned by."""
        shown = func.coalesce(usage.c.key_name, usage.c.key)  # rows from before: key = name
        columns = [c for c in usage.c if c.name not in ("key", "key_name")]
        query = select(shown.label("key"), usage.c.key.label("key_id"), *columns)
        if key is not None:
            query = query.where(usage.c.key == key)
        if name is not None:
            query = query.where(shown == name)
        if model is not None:
            query = query.where(usage.c.model == model)
        if start is not None:
            query = query.where(usage.c.day >= start.isoformat())
        if end is not None:
            query = query.where(usage.c.day <= end.isoformat())
        query = query.order_by(usage.c.day, shown, usage.c.key, usage.c.model)
        with self.db.read() as db:
            return [dict(row) for row in db.execute(query).mappings()]

    def expire(self, now: float | None = None) -> int:
        """Forget the ids of flushes older than ``FLUSH_IDS_SECONDS``; how many."""
        now = time.time() if now is None else now
        with self.db.write() as db:
            return db.execute(
                delete(usage_flushes).where(usage_flushes.c.at < now - FLUSH_IDS_SECONDS)
            ).rowcount


def batch_usage(results: Iterable[bytes]) -> dict[str, Any]:
    """OpenAI's Batch ``usage``: the sum of the ``usage`` of a job's answers
    (output file lines; chat and completions' names, or the Responses API's)."""
    tokens = dict.fromkeys(("input", "output", "cached", "reasoning"), 0)
    for result in results:
        try:
            usage = msgspec.json.decode(result)["response"]["body"]["usage"]
        except (msgspec.DecodeError, KeyError, TypeError):
            continue
        if not isinstance(usage, dict):
            continue
        tokens["input"] += _count(usage, "prompt_tokens", "input_tokens")
        tokens["output"] += _count(usage, "completion_tokens", "output_tokens")
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        tokens["cached"] += _count(details, "cached_tokens")
        details = usage.get("completion_tokens_details") or usage.get("output_tokens_details")
        tokens["reasoning"] += _count(details, "reasoning_tokens")
    return {
        "input_tokens": tokens["input"],
        "input_tokens_details": {"cached_tokens": tokens["cached"]},
        "output_tokens": tokens["output"],
        "output_tokens_details": {"reasoning_tokens": tokens["reasoning"]},
        "total_tokens": tokens["input"] + tokens["output"],
    }


def _count(usage: Any, *names: str) -> int:
    """The first of ``names`` that ``usage`` has as an integer, or 0."""
    if isinstance(usage, dict):
        for name in names:
            value = usage.get(name)
            if isinstance(value, int):
                return value
    return 0
