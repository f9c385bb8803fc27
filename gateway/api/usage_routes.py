"""``GET /v1/usage``: what each API key used, per model and UTC day (``gateway.state.usage``).

Filters, all optional, in the query string: ``key`` (a key's name),
``model``, and ``start_date`` / ``end_date`` (``YYYY-MM-DD``, UTC days, both
included). A key sees its own usage only, its id's (``key`` may name no
other than its own name), so a name revoked and added again with a new
secret starts from nothing; an ``admin`` key, or any caller when no keys
are configured, sees every key's. A filter that is malformed, repeated or
unknown is a 400. Rows show the key's name (``key``) and its id
(``key_id``: two keys that had one name are two rows). The answer::

    {"object": "list",
     "data": [{"object": "usage", "key": "team-a", "key_id": "key_9f86d081884c7d65",
               "model": "m", "date": "2025-06-01",
               "requests": 3, "prompt_tokens": 30, "completion_tokens": 12,
               "cached_tokens": 0, "total_tokens": 42}, ...],
     "total": {"requests": 3, "prompt_tokens": 30, "completion_tokens": 12,
               "cached_tokens": 0, "total_tokens": 42},
     "budgets": [{"object": "budget", "key": "team-a", "key_id": "key_9f86d081884c7d65",
                  "budget": "usd_per_month", "period": "2025-06", "limit": 50.0,
                  "spent": 1.25, "remaining": 48.75, "resets_at": 1751328000}, ...]}

``budgets`` are the budgets of the keys shown (``gateway.tenants.budgets``), for
the current day and month, whatever the date filters, as the limits store
counts them now (spend reserved by requests under way included).

Rows come by date, key and model. Each gateway process flushes its counts
every few seconds (``gateway.state.ledger``), so a request shows here
within that long.
"""

from __future__ import annotations

import re
from datetime import date
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway import errors
from gateway.api.services import services_of
from gateway.context import context_of
from gateway.dialects.jsonresp import json_response
from gateway.endpoints import Endpoints
from gateway.state.usage import COUNTS
from shared import routes

FILTERS = ("key", "model", "start_date", "end_date")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


async def usage(request: Request) -> Response:
    params = request.query_params
    unknown = sorted(set(params) - set(FILTERS))
    if unknown:
        raise errors.BadRequest(
            f"Unknown filter {unknown[0]!r}: the filters are {', '.join(FILTERS)}.", unknown[0]
        )
    for name in FILTERS:
        if len(params.getlist(name)) > 1:
            raise errors.BadRequest(f"`{name}` may be given once.", name)
    start, end = (
        _date(params.get("start_date"), "start_date"),
        _date(params.get("end_date"), "end_date"),
    )
    if start is not None and end is not None and start > end:
        raise errors.BadRequest("`start_date` is after `end_date`.", "start_date")
    shown = params.get("key")
    context = context_of(request.scope)
    viewer = context.viewer
    if viewer is not None:
        if shown is not None and shown != context.key_name:
            raise errors.BadRequest(
                "`key`: an API key sees its own usage only (an admin key sees every key's).",
                "key",
            )
        shown = None  # its id's rows, whatever name they show
    services = services_of(request)
    store = services.store
    rows = await store.call(store.usage.rows, viewer, params.get("model"), start, end, shown)
    if viewer is not None:
        keys = [context.key] if context.key is not None else []
    else:
        keys = [entry for entry in services.keys.entries() if shown in (None, entry.name)]
    budgets = []
    for entry in keys:
        for standing in await services.limits.spending.standing(entry):
            budgets.append(
                {"object": "budget", "key": entry.name, "key_id": entry.id, **standing.as_dict()}
            )
    return json_response(
        {
            "object": "list",
            "data": [_row(row) for row in rows],
            "total": _with_total({name: sum(row[name] for row in rows) for name in COUNTS}),
            "budgets": budgets,
        }
    )


def _date(value: str | None, name: str) -> date | None:
    if value is None:
        return None
    try:
        if not _DATE.fullmatch(value):
            raise ValueError
        return date.fromisoformat(value)
    except ValueError:
        raise errors.BadRequest(
            f"`{name}` must be a date as YYYY-MM-DD (a UTC day), not {value!r}.", name
        ) from None


def _row(row: dict[str, Any]) -> dict[str, Any]:
    counts = {name: int(row[name]) for name in COUNTS}
    return {
        "object": "usage",
        "key": row["key"],
        "key_id": row["key_id"],
        "model": row["model"],
        "date": row["day"],
        **_with_total(counts),
    }


def _with_total(counts: dict[str, int]) -> dict[str, int]:
    return {**counts, "total_tokens": counts["prompt_tokens"] + counts["completion_tokens"]}


# What this module answers (gateway.app wires every module's table).
ENDPOINTS: Endpoints = {
    (routes.USAGE, "GET"): usage,
}
