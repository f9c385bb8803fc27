"""Fixtures shared by the whole suite.

The integration tests share one real system per session: ``llmgate serve``
with one real vLLM CPU worker serving the embedded model (``--enforce-eager``
for a ~30 s start). It is started on free loopback ports as soon as the
tests are collected, when one of them will use it (so it starts while the
tests that need none run), and stopped at the end of the session. Modules
with engines of their own get them started one module ahead
(tests/harness/prestart.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shared.ports import free_port, free_port_range
from tests.harness import prestart
from tests.harness.cpu_heartbeats import CpuHeartbeats
from tests.harness.postgres_server import PostgresServer
from tests.harness.redis_server import RedisServer
from tests.harness.stall_watch import LoopWatch, StallWatch, report, watched_policy

MODEL = "smollm2-135m-instruct"
# A failure bound, not an expectation: a CPU engine is ready in 30-60 s on an
# idle machine, and took over 300 s on one running four other engines (a
# process that exits is reported at once, whatever this is).
STARTUP_TIMEOUT = 900.0
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Served:
    """A running ``llmgate serve`` and where to reach it."""

    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    # ZeroMQ address of worker i is tcp://127.0.0.1:(worker_port + i).
    worker_port: int = 0
    # Prometheus port of worker 0 (vLLM's metrics), when it serves them.
    worker_metrics_port: int = 0
    # Healthy workers the gateway must report before it counts as ready.
    healthy: int = 1

    @property
    def model_dir(self) -> str:
        """The embedded model's directory (for its tokenizer)."""
        from shared.embedded import default_model_dir

        return str(default_model_dir())

    def worker_addresses(self, count: int = 1) -> str:
        return ",".join(f"tcp://127.0.0.1:{self.worker_port + i}" for i in range(count))

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_for_log(self, text: str, timeout: float = 60, since: int = 0) -> str:
        """The log (from character ``since`` on) once ``text`` is in it; fails,
        showing the log's tail, after ``timeout`` (a hang guard: a process at a
        small share of a core may log what it must seconds late)."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.log_path.read_text(errors="replace")[since:]
            if text in log:
                return log
            if time.monotonic() > deadline:
                tail = self.log_tail()
                raise AssertionError(f"{text!r} not in the log within {timeout}s:\n{tail}")
            time.sleep(0.2)


# The session worker parses tool calls in the Hermes format (<tool_call>{...}
# </tool_call>), which the embedded model writes when shown it
# (tests/integration/test_tools.py); vLLM's server in the parity test has them too.
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def engine_on_last_core() -> dict[str, str]:
    """The environment of a module's one-engine system: its engine computes on
    the last core only, one thread, where the session's computes on the
    others (``launch_session_serve``). On every core, as ``llmgate serve``'s
    default has it, its threads meet at a barrier every layer: each step
    waits for whichever of them the machine ran last (the session's engine,
    the test process, a busy core), and the others spin meanwhile. Measured
    on 2 cores, one engine beside ``stress-ng --cpu 1``: a 64-token answer
    4.2-4.4 s on both cores against 3.3-3.4 s on one, at half the CPU time.
    The default layout itself is tested on the launcher's system
    (test_launcher_processes.py)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[-1]), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def start_serve(
    log_path: Path, *extra: str, env: dict[str, str] | None = None, num_workers: int = 1
) -> Served:
    """Start ``llmgate serve`` on free ports; return once every worker is healthy."""
    return wait_ready(launch_serve(log_path, *extra, env=env, num_workers=num_workers))


def launch_serve(
    log_path: Path, *extra: str, env: dict[str, str] | None = None, num_workers: int = 1
) -> Served:
    """Start ``llmgate serve`` on free ports and return at once (``wait_ready`` next)."""
    port = free_port()
    worker_port = free_port_range(num_workers)
    argv = [
        *(sys.executable, "-m", "serve", "--port", str(port)),
        *("--worker-base-port", str(worker_port), "--num-workers", str(num_workers)),
        *("--enforce-eager", *extra),
    ]
    return _launch(argv, log_path, port, env, worker_port, num_workers)


# A request that finds its worker marked down (starved of CPU for the
# gateway's 3 s --heartbeat-timeout on this shared machine) waits up to a
# minute for it rather than the default 5 s, then a 503, and a request under
# way on it waits two minutes (--stall-timeout) rather than 30 s: the tests
# on the session's gateway and the lone ones are about other things. (The
# 503 itself: test_curve.py, test_launcher_processes.py, tests/faults/.)
PATIENCE = {
    "LLMGATE_STARTUP_TIMEOUT": "60",
    "LLMGATE_STALL_TIMEOUT": "120",
    # A busy machine may answer a Redis call late; the limit must still hold
    # between processes (a Redis that is down is refused at once, whatever this).
    "LLMGATE_LIMITS_TIMEOUT": "30",
}


def start_gateway(
    log_path: Path, workers: str, *extra: str, env: dict[str, str] | None = None
) -> Served:
    """Start a lone ``llmgate gateway`` in front of running workers (with ``PATIENCE``)."""
    port = free_port()
    argv = [sys.executable, "-m", "gateway.main", "--workers", workers, "--port", str(port)]
    launched = _launch(
        [*argv, *extra], log_path, port, {**PATIENCE, **(env or {})}, 0, len(workers.split(","))
    )
    return wait_ready(launched)


def _launch(
    argv: list[str],
    log_path: Path,
    port: int,
    env: dict[str, str] | None,
    worker_port: int,
    healthy_workers: int,
) -> Served:
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    return Served(proc, f"http://127.0.0.1:{port}", log_path, worker_port, healthy=healthy_workers)


def wait_ready(served: Served) -> Served:
    """``served`` once its gateway is ready with every worker healthy; a process
    that exits is reported at once, one not ready in STARTUP_TIMEOUT is stopped."""
    name = served.proc.args[2]  # type: ignore[index]
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if served.proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {served.proc.returncode}:\n{served.log_tail()}")
        try:
            response = httpx.get(f"{served.base_url}/ready", timeout=2)
            if response.status_code == 200 and response.json()["healthy_workers"] >= served.healthy:
                return served
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_serve(served)
    raise RuntimeError(f"{name} not ready after {STARTUP_TIMEOUT}s:\n{served.log_tail()}")


def stop_serve(served: Served, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
    if served.proc.poll() is None:
        served.proc.send_signal(sig)
    try:
        return served.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        return served.proc.wait()


def kv_events_config(port: int, replay_port: int = 0) -> str:
    """vLLM's ``--kv-events-config``: its KV cache events over ZeroMQ on ``port``, and
    missed batches replayed on ``replay_port`` (0: none)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    if replay_port:
        config["replay_endpoint"] = f"tcp://*:{replay_port}"
    return json.dumps(config)


def launch_session_serve(directory: Path) -> Served:
    """The session's system, started (not yet ready)."""
    metrics_port = free_port()
    # TGI-style limits on the session's worker (tests/integration/test_api_surface.py).
    limits = {"LLMGATE_MAX_INPUT_TOKENS": "4000", "LLMGATE_MAX_TOTAL_TOKENS": "6000"}
    # Unlike llmgate serve's default (every core), the session's engine keeps
    # the last core for the other engines the suite starts beside it (the
    # modules' own: engine_on_last_core, and the two-worker system): with
    # all of them computing on every core, each step waits on the others'
    # threads. This also shows the environment winning over the default
    # (tests/integration/test_cpu_layout.py); the default itself is checked
    # on a system of its own (tests/integration/test_launcher_processes.py).
    engine = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    running = launch_serve(
        directory / "serve.log",
        "--worker-metrics-port",
        str(metrics_port),
        *TOOL_FLAGS,
        # vLLM logs each request its engine takes ("Added request ID-..."):
        # what the batch tests count to see that no line ran twice
        # (tests/integration/test_batches.py, engine_runs).
        "--enable-log-requests",
        # Its engine publishes its KV cache events (tests/integration/test_kv_events.py).
        "--kv-events-config",
        kv_events_config(free_port()),
        env={**limits, **engine, **PATIENCE},
    )
    running.worker_metrics_port = metrics_port
    return running


def pytest_sessionstart(session: pytest.Session) -> None:
    """Every system this session starts keeps its default state store (batches,
    files, responses: ``--state-dir``'s default) under pytest's base directory:
    not the user's, and not another test session's (``make test`` runs three at
    once, scripts/test.sh), whose gateways would claim its batch lines."""
    base = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    os.environ["XDG_STATE_HOME"] = str(base / "xdg-state")


# Started as soon as the tests are collected when one of them will use it, so
# its engine starts while the tests that need none run (the deploy, fault and
# unit tests come first): the first integration test does not wait ~40 s.
_early_serve: list[Served] = []


# Modules moved in the run order: the two-worker system (two engines, the
# slowest to start) comes up while the module with a system before it runs
# (tests/harness/prestart.py). In name order that is the tracing module, about 35 s,
# and the two-worker tests waited 22 s for their system; after the parity
# module (about 3 minutes) it is ready when they start.
_RUN_AFTER = {"test_two_workers.py": "test_parity.py"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-prestart",
        action="store_true",
        help="start each module's own system when the module does, not one module ahead "
        "(tests/harness/prestart.py)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for moved, anchor in _RUN_AFTER.items():
        mine = [item for item in items if item.path.name == moved]
        rest = [item for item in items if item.path.name != moved]
        after = [n for n, item in enumerate(rest) if item.path.name == anchor]
        if mine and after:
            items[:] = rest[: after[-1] + 1] + mine + rest[after[-1] + 1 :]


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    factory = session.config._tmp_path_factory  # type: ignore[attr-defined]
    session_system = any("served" in getattr(i, "fixturenames", ()) for i in session.items)
    if session_system:
        _early_serve.append(launch_session_serve(factory.mktemp("serve")))
    # The systems of single modules, one ahead (tests/harness/prestart.py); the first
    # once the session's is ready.
    ahead = not session.config.getoption("no_prestart")
    prestart.plan(session.items, factory, start_first=not session_system, ahead=ahead)


# Systems told to stop, each reaped by a thread of its own (``stop_later``).
_stopping: list[threading.Thread] = []


def stop_later(served: Served) -> None:
    """Stop a module's system without waiting: its engines take ~6 s to shut
    down, while the next module's system starts. A thread waits for it (no
    zombie is left for a test that looks at every process) and kills it if it
    has not stopped in a minute; the session's end waits for those threads."""
    thread = threading.Thread(target=stop_serve, args=(served,), name="stop-later")
    thread.start()
    _stopping.append(thread)


def launched_ahead(running: Served, value: object = None) -> prestart.Launched:
    """``running`` started for tests/harness/prestart.py (or ``value``, which holds it),
    stopped with ``stop_serve`` if no test takes it."""
    return prestart.Launched(running if value is None else value, lambda: stop_serve(running))


@contextmanager
def module_system(launched: Served) -> Iterator[Served]:
    """A module's system once ready, stopped in the background after the module."""
    try:
        yield wait_ready(launched)
    finally:
        stop_later(launched)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A system started early that no test got to use (the run stopped first),
    and those told to stop."""
    for running in _early_serve:
        stop_serve(running)
    prestart.stop_untaken()
    for thread in _stopping:
        thread.join()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The cores' heartbeats, once the summary has told the stalls with them."""
    if _watch.cores is not None:
        _watch.cores.stop()


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if _early_serve:
        running = _early_serve.pop()
    else:
        running = launch_session_serve(tmp_path_factory.mktemp("serve"))
    try:
        wait_ready(running)
        prestart.start_first_system(tmp_path_factory)
        yield running
    finally:
        stop_serve(running)


@pytest.fixture(scope="session")
def base_url(served: Served) -> str:
    return served.base_url


@contextmanager
def gateway_pair(
    served: Served,
    directory: Path,
    *flags: str,
    each: Callable[[str], Sequence[str]] = lambda name: (),
) -> Iterator[tuple[Served, Served]]:
    """Two lone gateway processes, ``a`` and ``b``, in front of the session's
    worker, with ``flags`` and ``each(name)`` of their own (a state directory)."""
    workers = served.worker_addresses(1)
    first = start_gateway(directory / "a.log", workers, *flags, *each("a"))
    try:
        second = start_gateway(directory / "b.log", workers, *flags, *each("b"))
        try:
            yield first, second
        finally:
            stop_serve(second)
    finally:
        stop_serve(first)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real Redis for the session (Debian's, tests/harness/redis_server.py),
    started the first time a test asks for it; the cache's outage test stops and
    starts it again."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """One real PostgreSQL for the session (Debian's, tests/harness/postgres_server.py),
    started the first time a test asks for it; each test takes a database of its
    own with ``postgres_server.create_database(name)``."""
    server = PostgresServer(tmp_path_factory.mktemp("postgres"))
    server.start()
    try:
        yield server
    finally:
        server.remove()


# A stall of the test process is told with what each core did meanwhile: a
# core nobody else got (one task kept it, or its host did not run it) or
# cores shared as usual (tests/harness/cpu_heartbeats.py).
_watch = StallWatch(CpuHeartbeats())
# Every event loop the tests run ticks for this watch (tests/harness/stall_watch.py).
_loops = LoopWatch(_watch)
asyncio.set_event_loop_policy(watched_policy(_loops))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A failed test's report says what the machine did meanwhile (tests/harness/stall_watch.py)."""
    outcome = yield
    result = outcome.get_result()
    if result.failed:
        # Every system the suite started logs under pytest's base directory.
        base = item.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
        logs = sorted(base.rglob("*.log"))
        result.sections.append(("machine", report(_watch, call.start, call.stop, logs, _loops)))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Every stall of the test process and of its event loops this session, passed
    tests included (a stall that a test survived is still a stall to explain);
    the loop stalls' stacks go to loop-stalls.txt under pytest's base directory."""
    stalls = _watch.between(0, float("inf"))
    loop_stalls = _loops.between(0, float("inf"))
    reporter = terminalreporter
    reporter.section("stalls")
    worst = max((s.seconds for s in stalls), default=0.0)
    reporter.write_line(
        f"test process stalled {len(stalls)} times (worst {worst:.1f} s late); "
        f"its event loops went {len(loop_stalls)} times without running for "
        f"{_loops.after:.0f} s or more"
    )
    for stall in stalls:
        reporter.write_line(f"  {_watch.describe(stall)}")
    late_beats = _watch.cores.late_beats() if _watch.cores is not None else []
    reporter.write_line(f"cores' heartbeats late {len(late_beats)} times")
    for beat in late_beats:
        reporter.write_line(f"  {beat}")
    if loop_stalls:
        base = reporter.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
        path = Path(base) / "loop-stalls.txt"
        path.write_text("\n\n".join(map(str, loop_stalls)))
        for stall in loop_stalls:
            reporter.write_line(f"  {str(stall).splitlines()[0]}")
        reporter.write_line(f"  stacks: {path}")
