"""``llmgate serve`` as processes: what runs, the gateway's settings, crash
restart, a clean stop, a stop with the message of a child that refuses
its settings, and no secret on any command line or in the log.

Slow: starts its own system (and a second engine after the crash), so it
does not disturb the session's shared one; the refusals start no engine.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import psycopg
import pytest
import redis
from psycopg import sql

from loadtest import capacity
from shared.ports import free_port, free_port_range
from tests.conftest import (
    MODEL,
    ROOT,
    STARTUP_TIMEOUT,
    Served,
    engine_on_last_core,
    launch_serve,
    launched_ahead,
    stop_serve,
    wait_ready,
)
from tests.harness import prestart
from tests.harness.postgres_server import PostgresServer
from tests.harness.redis_server import RedisServer
from tests.integration.test_cpu_layout import vllm_binding
from tests.integration.test_pool import wait_for

pytestmark = pytest.mark.slow


def children_by_role(launcher_pid: int) -> dict[str, psutil.Process]:
    roles = {}
    for child in psutil.Process(launcher_pid).children():
        try:
            cmdline = " ".join(child.cmdline())
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue  # a killed child the launcher has not reaped yet: no role now

        if "worker.main" in cmdline:
            roles["worker"] = child
        elif "gateway.main" in cmdline:
            roles["gateway"] = child
    return roles


def until_restarted(served: Served, old_pid: int) -> None:
    """Until a worker started in place of ``old_pid`` runs vLLM's engine core
    and model runner below it (each names itself)."""

    def restarted() -> bool:
        roles = capacity.server_processes(served.proc.pid, split_engine=True)
        engine = ("worker/VLLM::EngineCore", "worker/VLLM::Worker")
        new = [w for w in roles.get("worker", []) if w.pid != old_pid]
        return bool(new) and all(roles.get(name) for name in engine)

    wait_for(restarted, STARTUP_TIMEOUT, show=served.log_tail)


def complete(base_url: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/completions",
        timeout=timeout,
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 3},
    )


# The crash test's system (tests/harness/prestart.py): under make test its module runs in the
# session of the modules with systems of their own, which starts it as the module begins.
SYSTEM_FIXTURE = "launched"


def launch_system(directory: Path) -> prestart.Launched:
    running = launch_serve(directory / "serve.log", "--policy", "prefix")
    return launched_ahead(running)


@pytest.fixture
def launched(request: pytest.FixtureRequest) -> Served:
    """``llmgate serve --policy prefix`` started (the test waits for it and stops it)."""
    running: Served = prestart.take(request)
    return running


def test_crashed_worker_is_restarted_and_stop_leaves_no_process(launched: Served) -> None:
    served = launched
    try:
        wait_ready(served)
        # A gateway setting given to serve is the gateway's, not an engine
        # flag the worker would refuse (it once was, restarted forever).
        served.wait_for_log("routing policy: prefix")
        # The CPU default: one worker computing on every core, none held back
        # for vLLM's front end; the launcher logs it and vLLM's engine takes it.
        cores = sorted(os.sched_getaffinity(0))
        served.wait_for_log(
            f"CPU layout, {len(cores)} usable cores: worker-0 on cores all {len(cores)} "
            "(reserved for its front end: 0)"
        )
        assert vllm_binding(served.wait_for_log("reserve_cpu_num=0")) == cores
        launcher = psutil.Process(served.proc.pid)
        roles = children_by_role(launcher.pid)
        # One gateway and one worker; the worker runs vLLM's engine core below it.
        assert sorted(roles) == ["gateway", "worker"]
        assert "--policy=prefix" in roles["gateway"].cmdline()
        assert not any("policy" in arg for arg in roles["worker"].cmdline())
        assert len(launcher.children()) == 2
        assert roles["worker"].children(recursive=True), "no engine-core process"
        assert complete(served.base_url).status_code == 200

        old_worker = roles["worker"]
        # vLLM's IPC sockets are in a directory of the worker's own.
        old_rpc_dir = Path(old_worker.environ()["VLLM_RPC_BASE_PATH"])
        assert any(f.is_socket() for f in old_rpc_dir.iterdir()), list(old_rpc_dir.iterdir())
        old_worker.send_signal(signal.SIGKILL)
        # While the worker is gone nothing hangs: requests fail fast (a 503
        # after --startup-timeout, 5 s) or succeed. A hang would last
        # --request-timeout (600 s); the bound leaves room for a stalled machine.
        started = time.monotonic()
        during = complete(served.base_url, timeout=120)
        assert during.status_code in (200, 502, 503), during.text
        assert time.monotonic() - started < 60

        # The launcher starts a new worker with sockets of its own, the gateway
        # staying. The stop below comes once the new worker's engine processes
        # are all up, without waiting the rest of an engine's start: the
        # gateway taking a restarted worker back in is the last step of
        # test_two_workers' kill test, and a lone worker marked down coming
        # back to serve is test_pool's stalled lone worker.
        gateway_pid = roles["gateway"].pid
        until_restarted(served, old_worker.pid)
        roles = children_by_role(launcher.pid)
        assert roles["worker"].pid != old_worker.pid
        assert roles["gateway"].pid == gateway_pid
        # The killed worker's sockets went with it; the new one has its own.
        assert not old_rpc_dir.exists()
        rpc_dir = Path(roles["worker"].environ()["VLLM_RPC_BASE_PATH"])
        assert rpc_dir != old_rpc_dir and rpc_dir.is_dir()

        everything = [launcher, *launcher.children(recursive=True)]
    except BaseException:
        stop_serve(served)
        raise

    # Ctrl-C stops it all, engine-core processes included, and exits 0.
    assert stop_serve(served, signal.SIGINT) == 0
    alive = []
    for proc in everything:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    assert not rpc_dir.exists(), list(rpc_dir.iterdir())


def serve_until_it_exits(*flags: str, timeout: float = 240) -> tuple[int, str, float]:
    """Run ``llmgate serve`` with ``flags`` until it exits by itself: its
    status, its output and how long it ran. Fails after ``timeout``."""
    port, worker_port = free_port(), free_port_range(1)
    argv = [
        *(sys.executable, "-m", "serve", "--port", str(port)),
        *("--worker-base-port", str(worker_port), "--enforce-eager", *flags),
    ]
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # it stops its children
        output = proc.communicate(timeout=120)[0]
        pytest.fail(
            f"llmgate serve {' '.join(flags)} still ran after {timeout}s:\n{output[-5000:]}"
        )
    ran = time.monotonic() - started
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if f"127.0.0.1:{worker_port}" in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, f"processes of the stopped serve are left: {left}\n{output[-5000:]}"
    return proc.returncode, output, ran


def test_a_bad_engine_flag_stops_serve_with_the_workers_message() -> None:
    """The worker exits with argparse's status 2 (after importing vLLM): serve
    stops the gateway and exits with it, the worker's message last, no restart."""
    code, output, _ran = serve_until_it_exits("--no-such-flag")
    assert code == 2, output[-5000:]
    tail = output.rstrip().splitlines()[-3:]
    assert "llmgate worker: error: unrecognized arguments: --no-such-flag" in tail[-1], tail
    assert "worker-0 exited with status 2" in output and "restart 1 in" not in output


def test_a_gateway_refusing_its_settings_stops_serve_within_seconds(tmp_path: Path) -> None:
    """A keys file the gateway cannot read: it refuses at once, and serve stops
    (the worker still importing vLLM) with its message, instead of restarting it."""
    missing = tmp_path / "no-such-keys"
    code, output, ran = serve_until_it_exits("--api-keys-file", str(missing))
    assert code == 2, output[-5000:]
    message = f"llmgate gateway: cannot read --api-keys-file {missing}"
    assert message in output.rstrip().splitlines()[-1], output[-5000:]
    assert "gateway exited with status 2" in output and "restart 1 in" not in output
    # Seconds, not a worker's start: the bound leaves room for a loaded machine.
    assert ran < 60, output[-5000:]


def test_no_secret_on_a_command_line_or_in_the_log(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    """API keys, a PostgreSQL password (--state-db) and a Redis password
    (--limits, and --cache from serve's environment) reach the gateway through
    its environment: no process below serve has them on its command line
    (which any user can read), and serve's log shows the URLs redacted."""
    api_key = f"sk-{secrets.token_hex(8)}"
    db_password = f"pg{secrets.token_hex(8)}"
    redis_password = f"rd{secrets.token_hex(8)}"
    # A role with a password (the test cluster trusts local logins, so it is
    # not checked there; it is in the URL as a deployment's would be).
    with psycopg.connect(postgres_server.url, autocommit=True) as connection:
        connection.execute(
            sql.SQL("CREATE ROLE secretive LOGIN PASSWORD {}").format(sql.Literal(db_password))
        )
        connection.execute("CREATE DATABASE secretive OWNER secretive")
    state_db = f"postgresql://secretive:{db_password}@127.0.0.1:{postgres_server.port}/secretive"
    # A Redis of the test's own, which asks for its password.
    store = RedisServer(tmp_path)
    store.start()
    try:
        redis.Redis(port=store.port).config_set("requirepass", redis_password)
        limits = f"redis://:{redis_password}@127.0.0.1:{store.port}/0"
        cache = f"redis://:{redis_password}@127.0.0.1:{store.port}/1"
        # Flags given to serve are on its own command line (the caller's
        # choice); serve once passed them on as flags, and --cache too.
        served = launch_serve(
            tmp_path / "serve.log",
            *("--api-keys", api_key, "--state-db", state_db, "--limits", limits),
            env={**engine_on_last_core(), "LLMGATE_CACHE": cache},
        )
        try:
            wait_ready(served)
            answer = httpx.post(
                f"{served.base_url}/v1/completions",
                headers={"Authorization": f"Bearer {api_key}"},
                json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0},
                timeout=120,
            )
            assert answer.status_code == 200, answer.text
            # The cache's Redis took the answer: its password works.
            cached = redis.Redis(port=store.port, db=1, password=redis_password)
            wait_for(lambda: cached.dbsize() > 0, 60, show=served.log_tail)
            # Its URL is logged, redacted.
            served.wait_for_log(
                f"state store: postgresql://secretive:***@127.0.0.1:{postgres_server.port}/secretive"
            )
            launcher = psutil.Process(served.proc.pid)
            command_lines = {}
            for proc in launcher.children(recursive=True):
                try:
                    command_lines[proc.pid] = " ".join(proc.cmdline())
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    continue
        finally:
            stop_serve(served)
    finally:
        store.stop()
    assert any("gateway.main" in line for line in command_lines.values()), command_lines
    assert any("worker.main" in line for line in command_lines.values()), command_lines
    assert any("EngineCore" in line for line in command_lines.values()), command_lines
    log = served.log_path.read_text(errors="replace")
    for secret in (api_key, db_password, redis_password):
        on = [pid for pid, line in command_lines.items() if secret in line]
        assert not on, f"a secret on the command line of {on}: {command_lines}"
        assert secret not in log, f"a secret in serve's log:\n{served.log_tail(200)}"
