"""A stream's body: the worker's deltas out as server-sent events, until the last one.

:func:`relay` runs inside the response, once the first delta is in (so the
request can no longer be retried). A client that goes away cancels it (or
closes it) there, and its ``finally`` clause lets go of the request: the
handle closes, aborting it on the worker, and the request is counted. A
worker that fails or is lost from then on ends the stream with an error
event, unless the stream moves on to another worker
(``gateway.api.migration``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway import errors, metrics
from gateway.api.accounting import Accounting
from gateway.api.migration import Resume, Seam, moved_error
from gateway.dialects import sse
from gateway.dispatch.handle import Item, RequestHandle, WorkerLost
from shared import protocol

log = logging.getLogger(__name__)


async def relay(
    handle: RequestHandle,
    first: protocol.Delta,
    builder: sse.ResponseBuilder,
    account: Accounting,
    recorded: list[protocol.Delta] | None,
    store: Callable[[protocol.Usage], Awaitable[None]],
    resume: Resume | None = None,
    max_moves: int = 0,
) -> AsyncIterator[bytes]:
    """The events of ``handle``'s output from ``first`` on, through ``builder``.

    ``recorded`` keeps the deltas while the response cache may store the
    answer; ``store(usage)`` stores it once it finished normally. With
    ``resume``, the stream may move to another worker up to ``max_moves``
    times (``gateway.api.migration``).
    """
    include_usage = builder.include_usage
    # Log lines about the stream name its request (shared.logs).
    log_extra = {"request_id": account.context.request_id}
    item: Item = first
    last_chunk = 0.0
    status = 200
    usage = None
    itl = metrics.child(metrics.ITL, account.model)
    seam = Seam(max_moves, resume) if resume is not None and max_moves > 0 else None
    try:
        while True:
            if seam is not None and not isinstance(item, protocol.Delta):
                try:
                    moved = await seam.move(item, handle, account.span, log_extra)
                except errors.GatewayError as exc:
                    status = exc.status
                    log.warning("stream cut, and it found no worker: %s", exc, extra=log_extra)
                    yield builder.error_event(moved_error(exc))
                    break
                if moved is not None:
                    handle, item = moved
                    continue
            if isinstance(item, protocol.Failed):
                status = item.status
                # A stream under way ends early: worth a line, whatever the status.
                log.warning(
                    "stream ended by its worker: %d %s", item.status, item.message, extra=log_extra
                )
                yield builder.error_event(errors.from_status(item.status, item.message, item.param))
                break
            if isinstance(item, WorkerLost):
                status = 502
                log.warning("stream cut: %s", item.reason, extra=log_extra)
                yield builder.error_event(
                    errors.UpstreamFailed(f"The stream was cut: {item.reason}.")
                )
                break
            if item.usage is not None:
                usage = item.usage
                if include_usage:
                    yield builder.usage_chunk(item.usage)
                # Stored before the stream ends, so a client that reads
                # to [DONE] can count on the next request hitting.
                await store(usage)
                break
            now = time.monotonic()
            if last_chunk:
                itl.observe(now - last_chunk)
            else:
                account.first_chunk(now)
            last_chunk = now
            # Deltas that queued up meanwhile go out in the same write: one
            # transport write per batch, not per token, under load.
            chunks = [builder.chunk(item)]
            if recorded is not None:
                recorded.append(item)
            if seam is not None:
                seam.add(item)
            waiting = handle.next_nowait()
            while isinstance(waiting, protocol.Delta) and waiting.usage is None:
                chunks.append(builder.chunk(waiting))
                if recorded is not None:
                    recorded.append(waiting)
                if seam is not None:
                    seam.add(waiting)
                waiting = handle.next_nowait()
            yield chunks[0] if len(chunks) == 1 else b"".join(chunks)
            try:
                item = await handle.next() if waiting is None else waiting
            except errors.GatewayError as exc:
                status = exc.status
                log.warning("stream ended: %s", exc, extra=log_extra)
                yield builder.error_event(exc)
                break
        if builder.done:
            yield builder.done
    except (asyncio.CancelledError, GeneratorExit):
        status = 499
        raise
    except BaseException:
        status = 500
        raise
    finally:
        handle.close()
        # Cut or left before its usage came: billed what the engine computed.
        computed = seam.computed(handle) if seam is not None else handle.computed()
        account.finish(status, usage or computed)
