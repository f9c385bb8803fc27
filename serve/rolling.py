"""A rolling restart of ``llmgate serve``'s workers (SIGHUP), one at a time.

Each worker in turn is sent SIGTERM: it drains, and the gateway hands its
streams over to the others (``gateway.dispatch.pool.Pool.worker_draining``:
they go on mid-answer, no client sees an error) while what cannot move
finishes there. Once it has exited it is started again at once (no crash
backoff), and the next one goes only when it is ready (its engine started)
and the gateway counts every worker healthy and not draining again (its
``/health``), so
there is always another worker to move to. A worker that does not stop
within the stop grace is killed. The supervisor drives it (:meth:`Roll.step`,
a few times a second) and restarts the worker when it exits.
"""

from __future__ import annotations

import enum
import logging
import signal
import time
from collections.abc import Callable

import httpx

from serve.children import Child

log = logging.getLogger(__name__)

# Seconds between looks at the gateway's /health while a worker rejoins.
HEALTH_EVERY = 0.5
# A worker that has not rejoined the gateway's count within this long after
# its engine started: the roll goes on (and says so) rather than stop midway.
REJOIN_TIMEOUT = 120.0


class Phase(enum.Enum):
    DRAINING = "draining"
    STARTING = "starting"
    REJOINING = "rejoining"


def health_url(host: str, port: int) -> str:
    """The gateway's /health, from this host (a wildcard address: loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/health"


def serving_workers(url: str) -> int | None:
    """How many workers the gateway counts healthy and not draining (None: it
    did not answer). Not draining: a worker restarted faster than the
    gateway's heartbeat timeout never looks down, but the gateway's last word
    from its old process is that it drains, until the new one speaks."""
    try:
        response = httpx.get(url, timeout=2.0)
        if response.status_code != 200:
            return None
        body = response.json()
        return int(body["healthy_workers"]) - int(body["draining_workers"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


class Roll:
    """Workers restarted in turn; :meth:`step` moves it on, True once done."""

    def __init__(
        self,
        workers: list[Child],
        stop_grace: float,
        counted: Callable[[], int | None],
    ) -> None:
        self.queue = list(workers)
        self.total = len(workers)
        self.stop_grace = stop_grace
        # The gateway's count of workers serving (serving_workers).
        self.counted = counted
        self.current: Child | None = None
        self.phase = Phase.DRAINING
        self.since = 0.0
        self._looked = 0.0
        self.started_at = time.monotonic()
        log.info(
            "rolling restart of %d workers: %s",
            self.total,
            ", ".join(c.name for c in self.queue),
        )

    def owns(self, child: Child) -> bool:
        """Whether ``child``'s exit is the roll's doing (not a crash)."""
        return child is self.current and self.phase is Phase.DRAINING

    def exited(self, child: Child, code: int) -> None:
        """The draining worker exited: start it again now."""
        log.info(
            "rolling restart: %s drained in %.0fs (exit %s); starting it again",
            child.name,
            time.monotonic() - self.since,
            code,
        )
        child.start()
        self._enter(Phase.STARTING)

    def step(self, now: float) -> bool:
        """Move on where the current worker allows; True once every one rolled."""
        child = self.current
        if child is None:
            if not self.queue:
                log.info(
                    "rolling restart done: %d workers in %.0fs",
                    self.total,
                    now - self.started_at,
                )
                return True
            child = self.current = self.queue.pop(0)
            if child.proc is None or child.proc.poll() is not None:
                # Down already (a crash's backoff): the supervisor starts it.
                log.info("rolling restart: %s is down; waiting for it", child.name)
                self._enter(Phase.STARTING)
                return False
            log.info("rolling restart: draining %s", child.name)
            child.signal(signal.SIGTERM)
            self._enter(Phase.DRAINING)
            return False
        if self.phase is Phase.DRAINING:
            if now - self.since > self.stop_grace:
                log.warning("rolling restart: %s did not drain in time: killing it", child.name)
                child.signal_group(signal.SIGKILL)
                self.since = now
        elif self.phase is Phase.STARTING:
            if child.proc is not None and child.check_ready():
                self._enter(Phase.REJOINING)
        elif now - self._looked >= HEALTH_EVERY:
            self._looked = now
            healthy = self.counted()
            if healthy is not None and healthy >= self.total:
                log.info(
                    "rolling restart: %s is back (%d of %d workers serving)",
                    child.name,
                    healthy,
                    self.total,
                )
                self.current = None
            elif now - self.since > REJOIN_TIMEOUT:
                log.warning(
                    "rolling restart: the gateway counts %s of %d workers serving %.0fs "
                    "after %s started; going on",
                    healthy,
                    self.total,
                    REJOIN_TIMEOUT,
                    child.name,
                )
                self.current = None
        return False

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        self.since = time.monotonic()
