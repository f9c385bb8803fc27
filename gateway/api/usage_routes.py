"""``GET /v1/usage``: what each API key used, per model and UTC day (``gateway.state.usage``).

The answer is the usage rows the caller may see, filtered by the query string
(``key``, ``model``, ``start_date``, ``end_date``: a filter that is malformed,
repeated or unknown is a 400), their ``total``, and the ``budgets`` of the keys
shown (``gateway.tenants.budgets``) as the limits store counts them now. A key
sees its own id's rows only; an admin key, or any caller when no keys are
configured, sees every key's. Counting is not done here: a request shows once
its process has flushed its counts (``gateway.state.ledger``). The shapes and
filters users rely on are in docs/tenants.md (Usage, Budgets).
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
