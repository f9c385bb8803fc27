"""``llmgate serve``: start one worker per GPU (or N CPU workers) and a gateway; supervise.

* GPUs: one worker per visible GPU, each with its own ``CUDA_VISIBLE_DEVICES``.
* No GPU: ``--num-workers`` CPU workers (1 by default: measured best on 2
  cores). With one, vLLM binds its threads to every usable core; with
  several, the cores are split evenly and each worker is pinned to its own
  slice (``VLLM_CPU_OMP_THREADS_BIND``). Either way no core is held back for
  vLLM's front end (``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` unless the
  environment sets it), and the layout is logged at start.
* A worker that exits is restarted with exponential backoff (reset after it
  has run a minute); so is the gateway. A child that exits at once instead
  (status 2, a usage or configuration error: argparse's, or settings it
  refuses; or any exit within ``EARLY_EXIT_SECONDS`` of its start) would do
  the same again: ``llmgate serve`` stops the others and exits non-zero,
  ending with that child's last lines of output.
* Each child's stderr (its log, argparse's message, a traceback) comes
  through the launcher (``Child.relay``), which keeps its last lines for
  that message; stdout (vLLM's log) is the launcher's own.
* Each child runs in its own process group, so stopping one also stops what
  it spawned (vLLM's engine-core process). SIGINT/SIGTERM stop them all:
  SIGTERM to each child's main process first, so gateways and workers drain
  (finish what is running); SIGKILL for whatever is left after the grace
  period, or at once on a second signal.
* On Linux the launcher is a child subreaper: processes a crashed worker
  leaves behind (vLLM's engine core and executor, which may sit in process
  groups of their own) become the launcher's children, and it kills them,
  so a restarted engine never competes with an orphaned old one and nothing
  outlives ``llmgate serve``.

The gateway's settings are flags of ``llmgate serve`` too (``--policy``,
``--api-keys-file``, ...): given, they go to the gateway only, but for those
a worker has too (``--heartbeat-interval``, ``--drain-timeout``), which go to
both, as their ``LLMGATE_*`` variables do. ``--workers`` is not one of them:
the gateway's workers are the ones serve starts. Flags the launcher does not
know are passed to every worker: they are vLLM engine flags (``--model``,
``--dtype``, ``--max-model-len``, ...).

With ``--config FILE`` (``shared.config``) the workers come from the file's
pools instead: each pool's workers get its model, served name, engine flags
(after the command line's, so the pool's win) and devices (GPU ids, or the
CPU cores each worker is pinned to), and the gateway reads the same file.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from shared import config as pools_config
from shared import settings
from shared.logs import setup_logging
from worker import rpc_dir

log = logging.getLogger("llmgate.launcher")

# Longer than a worker's default drain (30 s), so draining is not cut short.
STOP_GRACE_SECONDS = 40.0
HEALTHY_RUN_SECONDS = 60.0
# A child that exits sooner than this after its start did not get as far as
# serving: it refused its settings or could not start at all, and would do
# the same again after a restart. (A worker takes longer than this to import
# vLLM and parse its flags; argparse's status, 2, tells on it.)
EARLY_EXIT_SECONDS = 2.0
# What of a child's stderr the launcher keeps for the message that ends serve.
TAIL_BYTES = 16 * 1024
TAIL_LINES = 10
TAIL_LINE_CHARS = 500

# The gateway's settings that ``llmgate serve`` takes as flags and hands to
# its gateway: all but those serve decides itself (its own settings of the
# same names, which it passes on as it needs, and the workers' addresses).
GATEWAY_FLAGS = [
    name
    for name, *_ in settings.fields(settings.GatewaySettings)
    if name not in {n for n, *_ in settings.fields(settings.ServeSettings)} | {"workers"}
]
# Of those, the ones a worker has too go to the workers as well, as their
# LLMGATE_* variables would (a drain or heartbeat setting is the system's).
SHARED_FLAGS = [
    name
    for name in GATEWAY_FLAGS
    if name in {n for n, *_ in settings.fields(settings.WorkerSettings)}
]
# Flags whose values stay out of the log, which shows each child's command
# line (API keys never reach a log).
SECRET_FLAGS = ("--api-keys",)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0
    backoff: float = field(default=1.0)
    # A worker's vLLM IPC sockets go in a directory of its own, removed once
    # it exits (worker.rpc_dir).
    own_rpc_dir: bool = False
    rpc_dir: str | None = None
    # The end of the current process's stderr, and the thread copying it.
    tail: bytearray = field(default_factory=bytearray)
    relay: threading.Thread | None = None

    def start(self) -> None:
        log.info("starting %s: %s", self.name, " ".join(redacted(self.argv)))
        env = dict(self.env)
        if self.own_rpc_dir:
            self.rpc_dir = rpc_dir.make(env, self.name)
        self.proc = subprocess.Popen(
            self.argv, env=env, start_new_session=True, stderr=subprocess.PIPE
        )
        self.started_at = time.monotonic()
        assert self.proc.stderr is not None
        self.tail = bytearray()
        self.relay = threading.Thread(
            target=relay_output,
            args=(self.proc.stderr, self.tail),
            name=f"relay-{self.name}",
            daemon=True,
        )
        self.relay.start()

    def last_lines(self, wait: float = 5.0) -> list[str]:
        """The last lines of the process's stderr, once it is copied through
        (its end, or ``wait`` seconds: a grandchild may hold the pipe open)."""
        if self.relay is not None:
            self.relay.join(wait)
        text = bytes(self.tail).decode(errors="replace")
        lines = [line.rstrip() for line in text.splitlines()]
        return [_clip(line) for line in lines if line.strip()][-TAIL_LINES:]

    def remove_rpc_dir(self) -> None:
        """Once it and its processes are gone."""
        rpc_dir.remove(self.rpc_dir)
        self.rpc_dir = None

    def signal(self, sig: int) -> None:
        """Signal the child's main process only (it drains, then stops its own children)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def redacted(argv: Sequence[str]) -> list[str]:
    """``argv`` with the values of ``SECRET_FLAGS`` hidden."""
    out: list[str] = []
    for arg in argv:
        name, eq, _value = arg.partition("=")
        if out and out[-1] in SECRET_FLAGS:
            out.append("***")
        elif name in SECRET_FLAGS and eq:
            out.append(f"{name}=***")
        else:
            out.append(arg)
    return out


def relay_output(source: IO[bytes], tail: bytearray) -> None:
    """Copy a child's stderr to ours as it comes (progress bars too: chunks,
    not lines), keeping its last ``TAIL_BYTES`` in ``tail``."""
    out = getattr(sys.stderr, "buffer", None)
    fd = source.fileno()
    while chunk := os.read(fd, 65536):
        if out is not None:
            try:
                out.write(chunk)
                out.flush()
            except (OSError, ValueError):
                # Our stderr is gone (a closed pipe): keep draining the
                # child's, or it would block on its next write.
                out = None
        tail += chunk
        del tail[:-TAIL_BYTES]
    source.close()


def _clip(line: str) -> str:
    return line if len(line) <= TAIL_LINE_CHARS else line[: TAIL_LINE_CHARS - 3] + "..."


def exited_at_once(code: int, ran: float) -> bool:
    """Whether a child that exited with ``code`` after ``ran`` seconds did so
    on a usage or configuration error, so that a restart would fail the same.

    Status 2 is argparse's and ``settings.refuse``'s, at any time. Otherwise
    any exit within ``EARLY_EXIT_SECONDS`` of the start, but not a death by
    a signal (negative ``code``): someone killed it, and it may well start.
    """
    if code == settings.SETTINGS_ERROR_STATUS:
        return True
    return code >= 0 and ran < EARLY_EXIT_SECONDS


def count_gpus() -> int:
    """GPUs visible to this process (nvidia-smi), without importing torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def cpu_slices(num_workers: int, cores: list[int]) -> list[str]:
    """Split ``cores`` into ``num_workers`` contiguous slices, as "a-b" ranges."""
    if num_workers > len(cores):
        raise ValueError(
            f"{num_workers} CPU workers need at least as many cores; "
            f"this machine gives us {len(cores)}"
        )
    per = len(cores) // num_workers
    slices = []
    for i in range(num_workers):
        chunk = cores[i * per : (i + 1) * per]
        slices.append(",".join(str(c) for c in chunk))
    return slices


def plan_workers(serve: settings.ServeSettings, engine_args: list[str]) -> list[Child]:
    gpus = count_gpus() if serve.device in ("auto", "gpu") else 0
    if serve.device == "gpu" and gpus == 0:
        settings.refuse("--device gpu, but no GPU is visible")
    base_env = dict(os.environ)
    children = []
    if gpus:
        for i in range(gpus):
            env = dict(base_env, CUDA_VISIBLE_DEVICES=str(i))
            children.append(_worker_child(i, serve, engine_args, env))
        return children
    cores = sorted(os.sched_getaffinity(0))
    slices = cpu_slices(serve.num_workers, cores) if serve.num_workers > 1 else [""]
    for i, cpu_slice in enumerate(slices):
        children.append(_worker_child(i, serve, engine_args, cpu_worker_env(base_env, cpu_slice)))
    log.info("%s", describe_cpu_layout(children, cores))
    return children


def cpu_worker_env(base_env: dict[str, str], cpu_slice: str) -> dict[str, str]:
    """The environment of a CPU worker computing on ``cpu_slice`` ("" = every usable core)."""
    env = dict(base_env)
    if cpu_slice:
        # Each worker computes on its own cores, with no core held back for
        # vLLM's front end (it would be taken from another worker).
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_slice
    # No core held back for vLLM's front end either when one worker has them
    # all: vLLM's default reserves one, which on a 2-core machine leaves half
    # of it idle; the front end's and the gateway's share is small (measured
    # in docs/benchmarks.md: 278 against 154 output tokens/s on 2 cores). The
    # environment still wins.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def describe_cpu_layout(children: list[Child], cores: list[int]) -> str:
    """One log line: which cores each CPU worker computes on, and what is held back."""
    parts = []
    for child in children:
        bind = child.env.get("VLLM_CPU_OMP_THREADS_BIND") or f"all {len(cores)}"
        reserved = child.env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "vLLM's default")
        parts.append(f"{child.name} on cores {bind} (reserved for its front end: {reserved})")
    return f"CPU layout, {len(cores)} usable cores: " + "; ".join(parts)


def plan_pool_workers(
    serve: settings.ServeSettings, config: pools_config.Config, engine_args: list[str]
) -> list[Child]:
    """The workers of every pool in ``config``, numbered across pools in file order."""
    gpus = count_gpus() if serve.device in ("auto", "gpu") else 0
    if serve.device == "gpu" and gpus == 0:
        settings.refuse("--device gpu, but no GPU is visible")
    # Workers whose pool names no devices share what the others leave free.
    declared = {n for pool in config.pools for d in pool.devices for n in _device_numbers(d)}
    count = sum(pool.workers for pool in config.pools if not pool.devices)
    if gpus:
        ids = [i for i in range(gpus) if i not in declared] or list(range(gpus))
        undeclared = iter([str(ids[i % len(ids)]) for i in range(count)])
    else:
        cores = sorted(os.sched_getaffinity(0))
        free = [c for c in cores if c not in declared] or cores
        if count == 0:
            undeclared = iter([])
        else:
            undeclared = iter(cpu_slices(count, free) if count > 1 or declared else [""])
    children: list[Child] = []
    for pool in config.pools:
        for devices in pool.devices or [next(undeclared) for _ in range(pool.workers)]:
            if gpus:
                env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices)
            else:
                env = cpu_worker_env(dict(os.environ), devices)
            args = [*engine_args, "--served-model-name", pool.model_name, *pool.engine_args]
            if pool.model:
                args += ["--model", pool.model]
            child = _worker_child(len(children), serve, args, env, pool=pool.name)
            child.name = f"{pool.name}-{child.name}"
            children.append(child)
    if not gpus:
        log.info("%s", describe_cpu_layout(children, cores))
    return children


def _device_numbers(devices: str) -> set[int]:
    """``"0,2-3"`` as ``{0, 2, 3}``."""
    numbers: set[int] = set()
    for part in devices.replace(" ", "").split(","):
        low, _, high = part.partition("-")
        numbers.update(range(int(low), int(high or low) + 1))
    return numbers


def worker_address(serve: settings.ServeSettings, index: int) -> str:
    return f"tcp://127.0.0.1:{serve.worker_base_port + index}"


def _worker_child(
    index: int,
    serve: settings.ServeSettings,
    engine_args: list[str],
    env: dict[str, str],
    pool: str = "",
) -> Child:
    argv = [
        sys.executable,
        "-m",
        "worker.main",
        "--bind",
        worker_address(serve, index),
        "--worker-id",
        f"worker-{index}",
        "--log-level",
        serve.log_level.upper(),
        "--log-format",
        serve.log_format,
    ]
    if pool:
        argv += ["--pool", pool]
    if serve.worker_metrics_port:
        argv += ["--metrics-port", str(serve.worker_metrics_port + index)]
    if serve.otlp_endpoint and not any(a.startswith("--otlp-traces-endpoint") for a in engine_args):
        # vLLM's own spans, in the trace the gateway starts for each request.
        argv += ["--otlp-traces-endpoint", serve.otlp_endpoint]
    argv += engine_args
    return Child(name=f"worker-{index}", argv=argv, env=env, own_rpc_dir=True)


def _gateway_child(
    serve: settings.ServeSettings, num_workers: int, gateway_flags: Sequence[str] = ()
) -> Child:
    workers = ",".join(worker_address(serve, i) for i in range(num_workers))
    argv = [
        sys.executable,
        "-m",
        "gateway.main",
        "--workers",
        workers,
        "--host",
        serve.host,
        "--port",
        str(serve.port),
        "--log-level",
        serve.log_level,
        "--log-format",
        serve.log_format,
        "--otlp-endpoint",
        serve.otlp_endpoint,
    ]
    if serve.config:
        argv += ["--config", str(Path(serve.config).resolve())]
    # The response cache and the state directory (batch jobs) are the gateway's.
    argv += [
        *("--cache", serve.cache, "--cache-ttl", str(serve.cache_ttl)),
        *("--cache-max-bytes", str(serve.cache_max_bytes), "--cache-scope", serve.cache_scope),
        *("--state-dir", serve.state_dir),
        *("--batch-max-inflight", str(serve.batch_max_inflight)),
        # The gateway's own settings given to serve (GATEWAY_FLAGS).
        *gateway_flags,
    ]
    return Child(name="gateway", argv=argv, env=dict(os.environ))


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
        # The child that exited at once (exited_at_once), its status and run time.
        self.failed: tuple[Child, int, float] | None = None

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
        become_subreaper()
        for child in self.children:
            child.start()
        try:
            while not self.stopping:
                self._check_children()
                time.sleep(0.2)
        finally:
            self._stop_all()
        if self.failed is None:
            return 0
        child, code, ran = self.failed
        # Last, so that it ends serve's output: the others' stopping came before.
        log.error(
            "%s exited with status %s %.1fs after its start: a usage or configuration "
            "error (status %d, or an exit within %.0fs), which a restart would repeat, "
            "so llmgate serve stops. Its last lines:\n%s",
            child.name,
            code,
            ran,
            settings.SETTINGS_ERROR_STATUS,
            EARLY_EXIT_SECONDS,
            "\n".join(f"    {line}" for line in child.last_lines()) or "    (none)",
        )
        return code if code > 0 else 1

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
            code = child.proc.poll()
            if code is None:
                continue
            # Whatever it spawned goes with it, or a new engine would compete
            # with an orphaned old one for memory and cores.
            child.signal_group(signal.SIGKILL)
            ran = now - child.started_at
            if exited_at_once(code, ran):
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgate serve",
        description="Start workers and a gateway and keep them running; a child that "
        "exits at once (a bad flag or setting) stops it with the child's message. "
        "The gateway's settings go to the gateway; unknown flags are passed to every "
        "worker (vLLM engine flags).",
        # An abbreviation of one of our flags is an engine flag's whole name
        # as often as not: whatever is not exactly ours goes to the workers.
        allow_abbrev=False,
    )
    settings.add_arguments(parser, settings.ServeSettings)
    settings.add_arguments(
        parser,
        settings.GatewaySettings,
        title=f"GatewaySettings, passed to the gateway (flags or {settings.ENV_PREFIX}* variables)",
        description=f"{' and '.join('--' + n.replace('_', '-') for n in SHARED_FLAGS)} go to "
        "the workers too; --workers is not taken: the gateway's workers are those serve starts.",
        skip=set(settings.GatewaySettings.__struct_fields__) - set(GATEWAY_FLAGS),
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    namespace, engine_args = build_parser().parse_known_args(argv)
    serve = settings.from_namespace(settings.ServeSettings, namespace)
    try:
        setup_logging(serve.log_level, serve.log_format)
    except ValueError as exc:
        settings.refuse(f"llmgate serve: {exc}")
    from gateway.cache import check_settings

    problem = check_settings(serve.cache, serve.cache_scope)
    if problem:
        settings.refuse(f"llmgate serve: {problem}")
    children = plan_children(serve, namespace, engine_args)
    sys.exit(Supervisor(serve, children).run())


def plan_children(
    serve: settings.ServeSettings, namespace: argparse.Namespace, engine_args: list[str]
) -> list[Child]:
    """The workers, then the gateway, from serve's parsed command line: the
    gateway's settings given (``GATEWAY_FLAGS``) go to the gateway, those a
    worker has too (``SHARED_FLAGS``) and the engine flags to every worker."""
    worker_args = [*settings.given_flags(namespace, SHARED_FLAGS), *engine_args]
    if serve.config:
        try:
            config = pools_config.load(serve.config)
        except pools_config.ConfigError as exc:
            settings.refuse(f"llmgate serve: {exc}")
        try:
            workers = plan_pool_workers(serve, config, worker_args)
        except ValueError as exc:
            settings.refuse(f"llmgate serve: {serve.config}: {exc}")
    else:
        workers = plan_workers(serve, worker_args)
    gateway_flags = settings.given_flags(namespace, GATEWAY_FLAGS)
    return [*workers, _gateway_child(serve, len(workers), gateway_flags)]


if __name__ == "__main__":
    main()
