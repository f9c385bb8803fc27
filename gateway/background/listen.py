"""Wake-ups from other replicas: PostgreSQL's LISTEN/NOTIFY carries "stored" at once.

On a shared store (``--state-db``), a runner's every write of a background
stream's events notifies ``CHANNEL`` with the stream's id, in the write's own
transaction (so at its commit: ``gateway.state.background``). Each gateway
process listens on one connection of its own and wakes its readers of that
stream (:class:`gateway.background.follow.Notices`), so a reader on another
replica than the runner's reads each event when it is stored instead of at
its next look. While the connection is down, readers look every
``follow.POLL_SECONDS`` as before; once it is back, every reader looks at
once, for what was stored meanwhile.
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
    while True:
        try:
            connection = await psycopg.AsyncConnection.connect(
                conninfo, autocommit=True, **connect_args
            )
            async with connection:
                await connection.execute(f"LISTEN {CHANNEL}")
                notices.listening = True
                # What was stored while nobody listened: every reader looks again.
                notices.tell_all()
                log.info("background streams: woken by the store's notifications")
                async for notice in connection.notifies():
                    notices.tell(notice.payload)
        # Any failure (the store down, restarted, the link cut): listen again
        # later; readers meanwhile look on their own.
        except Exception as exc:
            if notices.listening:
                log.warning("background streams: not listening to the store (%s)", exc)
        finally:
            notices.listening = False
        await asyncio.sleep(RECONNECT_SECONDS)
