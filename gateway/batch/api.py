"""OpenAI's Files and Batches API: ``/v1/files`` and ``/v1/batches``.

The shapes are OpenAI's (``gateway.state.files``, ``gateway.state.batches``),
so ``client.files.create`` and ``client.batches.create`` of the OpenAI SDK
work unchanged. Input files
are checked when uploaded and again when a batch is created from them
(``gateway.batch.jsonl``): bad input is a 400 naming the line, an unknown id
a 404. The state store is touched from a thread, never on the event loop,
and answers 503 while it cannot be reached.

With API keys, files and jobs belong to the key that made them, by its id
(a job's output and error files to the job's key): another key gets 404 for
them, never sees them listed, and a list's ``after`` naming one is an
unknown cursor (an empty page); an ``admin`` key sees all (``gateway.api.auth``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile
from starlette.types import Message, Receive

from gateway import errors
from gateway.api.http import header, read_body
from gateway.api.services import services_of
from gateway.batch import Batches, jsonl
from gateway.context import context_of
from gateway.dialects import schemas
from gateway.dialects.jsonresp import json_response
from gateway.endpoints import Endpoints
from gateway.state.files import UPLOADED
from gateway.tenants import limits
from shared import routes

# Purposes a file may be uploaded for: a batch's input is the only use here.
PURPOSES = UPLOADED
FILES_LIMIT = (10_000, 10_000)  # default and most, as OpenAI's
BATCHES_LIMIT = (20, 100)


def _batches(request: Request) -> Batches:
    batches: Batches = services_of(request).batches
    return batches


def _page(data: list[dict[str, Any]], has_more: bool) -> Response:
    return json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


def _limit(request: Request, bounds: tuple[int, int]) -> int:
    value = request.query_params.get("limit")
    if value is None:
        return bounds[0]
    if not value.isdigit() or not 1 <= int(value) <= bounds[1]:
        raise errors.BadRequest(f"`limit` must be an integer from 1 to {bounds[1]}.", "limit")
    return int(value)


# -- files ----------------------------------------------------------------------


async def create_file(request: Request) -> Response:
    """Upload a batch input file (multipart: ``file`` and ``purpose``): one of
    its key's requests (``gateway.tenants``), within its quota of stored bytes."""
    services = services_of(request)
    store = services.store
    context = context_of(request.scope)
    if context.key is not None and limits.has_limits(context.key):
        await services.limits.admit(context, context.key, lambda: (0, 0))
    limit = _batches(request).max_file_bytes
    declared = header(request, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    limited = Request(request.scope, _limited(request.receive, limit))
    async with limited.form(max_files=1, max_fields=8) as form:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose not in PURPOSES:
            raise errors.BadRequest(
                f"`purpose` must be {' or '.join(PURPOSES)}, not {purpose!r}.", "purpose"
            )
        if not isinstance(upload, UploadFile):
            raise errors.BadRequest("`file` is required: the JSONL file, as a file part.", "file")
        data = await upload.read()
        filename = upload.filename or "input.jsonl"
    await asyncio.to_thread(jsonl.parse, data)  # refused now, not when a batch is created
    expires_at = _expires_at(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"))
    owner = context.owner
    quota = services.settings.tenants.file_quota_bytes
    if owner is not None and quota:
        # Two uploads at once may both fit and together pass it, by one file at most.
        stored = await store.call(store.files.uploaded_bytes, owner)
        if stored + len(data) > quota:
            raise errors.PayloadTooLarge(
                f"This API key keeps {stored} bytes of uploaded files; {len(data)} more would "
                f"pass this server's --file-quota-bytes of {quota}. Delete files to make room.",
                "file",
            )
    return json_response(
        await store.call(store.files.add, data, filename, str(purpose), "", expires_at, owner)
    )


# OpenAI's bounds on a file's `expires_after[seconds]`: an hour to 30 days.
EXPIRES_AFTER_SECONDS = (3600, 30 * 24 * 3600)


def _expires_at(anchor: object, seconds: object) -> int | None:
    """A file's expiry from OpenAI's ``expires_after`` form fields (anchor
    ``created_at``, seconds), or None (kept until deleted)."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise errors.BadRequest(
            "`expires_after[anchor]` must be created_at.", "expires_after[anchor]"
        )
    low, high = EXPIRES_AFTER_SECONDS
    if not isinstance(seconds, str) or not seconds.isdigit() or not low <= int(seconds) <= high:
        raise errors.BadRequest(
            f"`expires_after[seconds]` must be an integer from {low} to {high}.",
            "expires_after[seconds]",
        )
    return int(time.time()) + int(seconds)


def _too_large(limit: int) -> errors.PayloadTooLarge:
    return errors.PayloadTooLarge(
        f"The file is larger than this server's --max-file-bytes of {limit} bytes.", "file"
    )


def _limited(receive: Receive, limit: int) -> Receive:
    """``receive``, refusing a body (say, a chunked one) once it passes ``limit`` bytes."""
    size = 0

    async def limited() -> Message:
        nonlocal size
        message = await receive()
        size += len(message.get("body", b""))
        if size > limit:
            raise _too_large(limit)
        return message

    return limited


async def list_files(request: Request) -> Response:
    store = services_of(request).store
    params = request.query_params
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise errors.BadRequest("`order` must be asc or desc.", "order")
    limit = _limit(request, FILES_LIMIT)
    data, more = await store.call(
        store.files.page,
        params.get("purpose"),
        params.get("after"),
        limit,
        order == "asc",
        context_of(request.scope).viewer,
    )
    return _page(data, more)


async def retrieve_file(request: Request, file_id: str) -> Response:
    store = services_of(request).store
    file = await store.call(store.files.get, file_id, context_of(request.scope).viewer)
    if file is None:
        raise _no_file(file_id)
    return json_response(file)


async def file_content(request: Request, file_id: str) -> Response:
    store = services_of(request).store
    content = await store.call(store.files.content, file_id, context_of(request.scope).viewer)
    if content is None:
        raise _no_file(file_id)
    return Response(content, media_type="application/octet-stream")


async def delete_file(request: Request, file_id: str) -> Response:
    store = services_of(request).store
    if not await store.call(store.files.delete, file_id, context_of(request.scope).viewer):
        raise _no_file(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


def _no_file(file_id: str, param: str | None = None) -> errors.NotFound:
    return errors.NotFound(f"No such file: {file_id!r}.", param)


# -- batches ----------------------------------------------------------------------


async def create_batch(request: Request) -> Response:
    batches = _batches(request)
    store = services_of(request).store
    raw = schemas.decode_body(await read_body(request, 1024 * 1024))
    file_id = raw.get("input_file_id")
    if not isinstance(file_id, str):
        raise errors.BadRequest("`input_file_id` must be a file id.", "input_file_id")
    jsonl.check_batch([], raw.get("endpoint"), raw.get("completion_window"))
    metadata = jsonl.check_metadata(raw.get("metadata"))
    viewer = context_of(request.scope).viewer

    def create() -> dict[str, Any]:
        file = store.files.get(file_id, viewer)
        content = store.files.content(file_id, viewer)
        if file is None or content is None:
            raise _no_file(file_id, "input_file_id")
        if file["purpose"] != "batch":
            raise errors.BadRequest(
                f"File {file_id} has purpose {file['purpose']!r}, not batch.", "input_file_id"
            )
        lines = jsonl.parse(content)
        endpoint = jsonl.check_batch(lines, raw["endpoint"], raw["completion_window"])
        return store.batches.create(
            file_id,
            endpoint,
            raw["completion_window"],
            metadata,
            lines,
            context_of(request.scope).owner,
        )

    batch = await store.call(create)
    batches.runner.wake()
    return json_response(batch)


async def list_batches(request: Request) -> Response:
    store = services_of(request).store
    limit = _limit(request, BATCHES_LIMIT)
    after = request.query_params.get("after")
    data, more = await store.call(
        store.batches.page, after, limit, context_of(request.scope).viewer
    )
    return _page(data, more)


async def retrieve_batch(request: Request, batch_id: str) -> Response:
    store = services_of(request).store
    batch = await store.call(store.batches.get, batch_id, context_of(request.scope).viewer)
    if batch is None:
        raise _no_batch(batch_id)
    return json_response(batch)


async def cancel_batch(request: Request, batch_id: str) -> Response:
    """Cancel a job: its lines in flight are aborted, those not run go to the error file."""
    batches = _batches(request)
    store = services_of(request).store
    batch = await store.call(
        store.batches.set_status,
        batch_id,
        "cancelling",
        ("validating", "in_progress"),
        context_of(request.scope).viewer,
    )
    if batch is None:
        raise _no_batch(batch_id)
    if batch["status"] not in ("cancelling", "cancelled"):
        raise errors.BadRequest(f"Batch {batch_id} is {batch['status']}: too late to cancel.")
    batches.runner.wake()
    return json_response(batch)


def _no_batch(batch_id: str) -> errors.NotFound:
    return errors.NotFound(f"No such batch: {batch_id!r}.")


# What this module answers (gateway.app wires every module's table).
ENDPOINTS: Endpoints = {
    (routes.FILES, "POST"): create_file,
    (routes.FILES, "GET"): list_files,
    (routes.FILE, "GET"): retrieve_file,
    (routes.FILE_CONTENT, "GET"): file_content,
    (routes.FILE, "DELETE"): delete_file,
    (routes.BATCHES, "POST"): create_batch,
    (routes.BATCHES, "GET"): list_batches,
    (routes.BATCH, "GET"): retrieve_batch,
    (routes.BATCH_CANCEL, "POST"): cancel_batch,
}
