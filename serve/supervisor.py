"""Keeps ``llmgate serve``'s children running, and stops them all together.

* A child that exits after it has been ready (``Child.check_ready``: it
  listened on its port) is restarted with exponential backoff (reset after
  it has run a minute). A child that fails its start instead, exiting
  before it was ever ready (however long it tried: a worker's engine takes
  a minute on a CPU) or with status 2 at any time (a usage or configuration
  error: argparse's, or settings it refuses), would do the same again:
  serve stops the others and exits non-zero, ending with that child's last
  lines of output.
* SIGHUP restarts the workers one at a time (``serve.rolling``): each
  drains, its streams moving on to the others, and starts again.
* SIGINT/SIGTERM stop them all: SIGTERM to each child's main process first,
  so gateways and workers drain (finish what is running); SIGKILL for
  whatever is left after the grace period, or at once on a second signal.
* On Linux the launcher is a child subreaper: processes a crashed worker
  leaves behind (vLLM's engine core and executor, which may sit in process
  groups of their own) become the launcher's children, and it kills them,
  so a restarted engine never competes with an orphaned old one and nothing
  outlives ``llmgate serve``.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import time

import psutil

from serve import rolling
from serve.children import Child
from shared import settings

log = logging.getLogger(__name__)

# Longer than a worker's default drain (30 s), so draining is not cut short.
STOP_GRACE_SECONDS = 40.0
HEALTHY_RUN_SECONDS = 60.0


def failed_at_start(code: int, ever_ready: bool) -> bool:
    """Whether a child that exited with ``code`` failed its start, so that a
    restart would fail the same, rather than crashed (restarted).

    Status 2 is argparse's and ``settings.refuse``'s, at any time. Otherwise
    an exit before the child was ever ready (a bad engine flag, a model
    that does not fit, a port in use: a restart gets no further),
    but not a death by a signal (negative ``code``): someone killed it, and
    it may well start. Once it has served, a failure is a crash, and even a
    restart that fails its start again is retried: what worked may again.
    """
    if code == settings.SETTINGS_ERROR_STATUS:
        return True
    return code >= 0 and not ever_ready


def become_subreaper() -> None:
    """Adopt orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``), so we can reap them."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_child_subreaper = 36
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    except (OSError, AttributeError) as exc:
        log.warning(
            "cannot become a child subreaper (%s): a crashed worker's engine "
            "processes may outlive it",
            exc,
        )


def kill_and_reap(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM ``procs``, wait up to ``grace`` seconds, SIGKILL what is left, reap all."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _gone, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


class Supervisor:
    def __init__(self, serve: settings.ServeSettings, children: list[Child]) -> None:
        self.serve = serve
        self.children = children
        self.stopping = False
        self.force = False
        # The child that failed its start (failed_at_start), its status and run time.
        self.failed: tuple[Child, int, float] | None = None
        # A rolling restart asked for (SIGHUP), and the one under way.
        self.roll_asked = False
        self.roll: rolling.Roll | None = None

    def request_roll(self, _signum: int, _frame: object) -> None:
        self.roll_asked = True

    def request_stop(self, signum: int, _frame: object) -> None:
        if self.stopping:
            log.warning("received %s again: killing everything now", signal.Signals(signum).name)
            self.force = True
            return
        log.info("received %s: stopping (again to stop at once)", signal.Signals(signum).name)
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_roll)
        become_subreaper()
        for child in self.children:
            child.start()
        try:
            while not self.stopping:
                self._check_children()
                self._roll()
                time.sleep(0.2)
        finally:
            self._stop_all()
        if self.failed is None:
            return 0
        child, code, ran = self.failed
        # Last, so that it ends serve's output: the others' stopping came before.
        log.error(
            "%s exited with status %s %.1fs after its start: it failed its start (a "
            "usage or configuration error, status %d, or an exit before it was ever "
            "ready), which a restart would repeat, so llmgate serve stops. "
            "Its last lines:\n%s",
            child.name,
            code,
            ran,
            settings.SETTINGS_ERROR_STATUS,
            "\n".join(f"    {line}" for line in child.last_lines()) or "    (none)",
        )
        return code if code > 0 else 1

    def _roll(self) -> None:
        if self.roll_asked:
            self.roll_asked = False
            if self.roll is not None:
                log.info("received SIGHUP: a rolling restart is under way already")
            else:
                workers = [c for c in self.children if c.worker]
                url = rolling.health_url(self.serve.host, self.serve.port)
                self.roll = rolling.Roll(
                    workers, STOP_GRACE_SECONDS, lambda: rolling.serving_workers(url)
                )
        if self.roll is not None and self.roll.step(time.monotonic()):
            self.roll = None

    def _reap_orphans(self) -> None:
        """Kill the processes an exited child left behind (adopted by us as subreaper)."""
        tracked = {c.proc.pid for c in self.children if c.proc is not None}
        orphans = [p for p in psutil.Process().children() if p.pid not in tracked]
        if orphans:
            descendants = [d for p in orphans for d in _descendants(p)]
            log.info("stopping %d processes left behind by an exited child", len(orphans))
            kill_and_reap(orphans + descendants, grace=2.0)

    def _check_children(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is None:
                if now >= child.next_start:
                    child.start()
                continue
            # (It looks at the child's sockets only until it has been ready.)
            child.check_ready()
            code = child.proc.poll()
            if code is None:
                continue
            # Whatever it spawned goes with it, or a new engine would compete
            # with an orphaned old one for memory and cores.
            child.signal_group(signal.SIGKILL)
            ran = now - child.started_at
            if self.roll is not None and self.roll.owns(child):
                child.proc = None
                self._reap_orphans()
                child.remove_rpc_dir()
                self.roll.exited(child, code)
                continue
            if failed_at_start(code, child.ever_ready):
                log.error(
                    "%s exited with status %s %.1fs after its start: stopping everything",
                    child.name,
                    code,
                    ran,
                )
                self.failed = (child, code, ran)
                self.stopping = True
                return
            child.backoff = (
                1.0
                if ran > HEALTHY_RUN_SECONDS
                else min(child.backoff * 2, self.serve.restart_backoff_max)
            )
            child.restarts += 1
            child.next_start = now + child.backoff
            child.proc = None
            self._reap_orphans()
            child.remove_rpc_dir()
            log.warning(
                "%s exited with %s after %.0fs; restart %d in %.0fs",
                child.name,
                code,
                ran,
                child.restarts,
                child.backoff,
            )

    def _stop_all(self) -> None:
        running = [c for c in self.children if c.proc is not None and c.proc.poll() is None]
        for child in running:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while not self.force and time.monotonic() < deadline:
            if all(c.proc is None or c.proc.poll() is not None for c in running):
                break
            time.sleep(0.1)
        for child in running:
            if child.proc is not None and child.proc.poll() is None:
                log.warning("%s did not stop in time: killing it", child.name)
        # SIGKILL the groups in any case: it reaps grandchildren a clean exit left.
        for child in self.children:
            child.signal_group(signal.SIGKILL)
            if child.proc is not None:
                child.proc.wait()
        # Anything still below us (adopted orphans, processes in groups of
        # their own) is stopped too: nothing outlives the launcher.
        leftovers = psutil.Process().children(recursive=True)
        if leftovers:
            kill_and_reap(leftovers, grace=5.0)
        for child in self.children:
            child.remove_rpc_dir()
            # Their last words (a drained gateway's, say) still come through.
            if child.relay is not None:
                child.relay.join(5.0)
        log.info("all processes stopped")


def _descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return list(proc.children(recursive=True))
    except psutil.NoSuchProcess:
        return []
