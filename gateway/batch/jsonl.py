"""A batch's input file: OpenAI's JSONL, one request per line, checked before a job starts.

Each line is ``{"custom_id": ..., "method": "POST", "url": ..., "body": {...}}``.
Everything OpenAI refuses up front and that is cheap to see is refused here,
as a 400 naming the line: a line that is not a JSON object, a missing or
empty ``custom_id``, a ``custom_id`` used twice (the output is matched to the
input by it), a method other than POST, a ``body`` that is not an object or
asks to stream, a ``url`` other than the batch's endpoint. What only the
request path can judge (an unknown model, a bad parameter) is the line's own
error in the error file, as with OpenAI.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway import errors
from gateway.dialects import schemas
from gateway.state.lines import Line
from shared.routes import ROUTES

# The endpoints a batch may run: the route table's batchable routes (sorted,
# so that a message lists them in one order).
ENDPOINTS = tuple(sorted(route.path for route in ROUTES if route.batchable))
COMPLETION_WINDOWS = ("24h",)
# OpenAI's limit on requests per batch.
MAX_LINES = 50_000


def parse(data: bytes) -> list[Line]:
    """The requests of a batch input file; 400 naming the first bad line."""
    lines: list[Line] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue  # a trailing newline, or blank lines between requests
        if len(lines) >= MAX_LINES:
            raise errors.BadRequest(
                f"The file has more than {MAX_LINES} requests, the most one batch may hold.",
                "file",
            )
        item = _object(raw, number)
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise _bad(number, "`custom_id` must be a non-empty string")
        if "\x00" in custom_id:
            # PostgreSQL's text cannot hold it: refused here, on every store alike.
            raise _bad(number, "`custom_id` must not contain a NUL character")
        if custom_id in seen:
            raise _bad(
                number,
                f"`custom_id` {custom_id!r} is also that of line {seen[custom_id]}; "
                "each request needs its own",
            )
        seen[custom_id] = number
        if item.get("method") != "POST":
            raise _bad(number, "`method` must be POST")
        url = item.get("url")
        if not isinstance(url, str):
            raise _bad(number, f"`url` must be a string, e.g. {ENDPOINTS[0]}")
        body = item.get("body")
        if not isinstance(body, dict):
            raise _bad(number, "`body` must be a JSON object (the request's body)")
        if body.get("stream"):
            raise _bad(number, "`stream` is not supported in a batch")
        lines.append(Line(len(lines), custom_id, url, msgspec.json.encode(body)))
    if not lines:
        raise errors.BadRequest("The file holds no request.", "file")
    return lines


def check_batch(lines: list[Line], endpoint: object, completion_window: object) -> str:
    """``endpoint``, once it and ``completion_window`` are valid and every line's
    ``url`` is the endpoint; 400 otherwise."""
    if endpoint not in ENDPOINTS:
        raise errors.BadRequest(
            f"`endpoint` must be one of {', '.join(ENDPOINTS)}, not {endpoint!r}.", "endpoint"
        )
    assert isinstance(endpoint, str)
    if completion_window not in COMPLETION_WINDOWS:
        raise errors.BadRequest(
            f"`completion_window` must be {' or '.join(COMPLETION_WINDOWS)}, "
            f"not {completion_window!r}.",
            "completion_window",
        )
    for line in lines:
        if line.url != endpoint:
            raise errors.BadRequest(
                f"Request {line.index + 1} ({line.custom_id!r}) has url {line.url!r}; "
                f"every request of this batch must be for its endpoint {endpoint}.",
                "input_file_id",
            )
    return endpoint


def check_metadata(metadata: object) -> dict[str, str] | None:
    """OpenAI's metadata rules: at most 16 string pairs, keys to 64 and values to 512
    characters."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise errors.BadRequest("`metadata` must be an object of at most 16 pairs.", "metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise errors.BadRequest(
                "`metadata` keys must be strings of at most 64 characters and values "
                "strings of at most 512.",
                "metadata",
            )
    return metadata


def _object(raw: bytes, number: int) -> dict[str, Any]:
    try:
        return schemas.decode_body(raw)
    except errors.BadRequest as exc:
        raise _bad(number, exc.message.replace("The request body", "it").rstrip(".")) from None


def _bad(number: int, why: str) -> errors.BadRequest:
    return errors.BadRequest(f"Line {number} of the file is not a valid request: {why}.", "file")
