"""Wake-ups from other replicas: PostgreSQL's LISTEN/NOTIFY carries "stored" at once.

On a shared store (``--state-db``), each runner tells ``CHANNEL`` which of its
streams have new events stored or ended, a batch of ids at a time once they
are committed (``gateway.background.runner``; a cancel does too). Each gateway
process listens on one connection of its own and wakes its readers of that
stream (:class:`gateway.background.follow.Notices`), so a reader on another
replica than the runner's reads each event when it is stored instead of at
its next look. While the connection is down, readers look every
``follow.POLL_SECONDS`` as before; once it is back, every reader looks at
once, for what was stored meanwhile. It takes one connection of each
gateway process, and needs one to the server itself: behind a pooler in
transaction mode (PgBouncer's) no notification arrives, and readers look
every ``follow.LISTENING_POLL_SECONDS``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg

from gateway.background.follow import Notices
from gateway.state.background import CHANNEL

log = logging.getLogger(__name__)

# Seconds between attempts to listen again after the connection failed.
RECONNECT_SECONDS = 2.0


async def listen(conninfo: str, connect_args: dict[str, Any], notices: Notices) -> None:
    """Until cancelled: each notification on ``CHANNEL`` wakes that stream's readers."""
    failed = False
    while True:
        try:
            connection = await psycopg.AsyncConnection.connect(
                conninfo, autocommit=True, **connect_args
            )
            async with connection:
                await connection.execute(f"LISTEN {CHANNEL}")
                notices.listening = True
                failed = False
                # What was stored while nobody listened: every reader looks again.
                notices.tell_all()
                log.info("background streams: woken by the store's notifications")
                async for notice in connection.notifies():
                    notices.tell(notice.payload)
        # Any failure (the store down, restarted, the link cut): listen again
        # later; readers meanwhile look on their own.
        except Exception as exc:
            if not failed:  # once a failure, not at each attempt
                log.warning("background streams: not listening to the store (%s)", exc)
            failed = True
        finally:
            if notices.listening:
                notices.listening = False
                # Their next look comes sooner now: each waits afresh.
                notices.tell_all()
        await asyncio.sleep(RECONNECT_SECONDS)
