"""``llmgate serve``: its plan (how many workers, on which devices and cores,
with which flags) and its supervisor."""

from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from serve import children, plan, supervisor
from serve import main as serve_main
from shared import config, settings
from shared.ports import free_port
from shared.settings import ServeSettings


def two_cores_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only machine with cores 0 and 1, no vLLM thread settings in the environment."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr(plan.os, "sched_getaffinity", lambda _pid: {0, 1})


def test_cpu_cores_are_split_evenly() -> None:
    assert plan.cpu_slices(2, [0, 1, 2, 3]) == ["0,1", "2,3"]
    assert plan.cpu_slices(3, [0, 1, 2, 3, 4, 5, 6]) == ["0,1", "2,3", "4,5"]


def test_more_workers_than_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="cores"):
        plan.cpu_slices(3, [0, 1])


def test_one_worker_per_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    children = plan.plan_workers(ServeSettings(), ["--model", "x"])
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children] == ["0", "1", "2"]
    assert all(c.argv[-2:] == ["--model", "x"] for c in children)
    binds = [c.argv[c.argv.index("--bind") + 1] for c in children]
    assert binds == ["tcp://127.0.0.1:5550", "tcp://127.0.0.1:5551", "tcp://127.0.0.1:5552"]


def test_cpu_workers_are_pinned_to_their_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(plan.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    children = plan.plan_workers(ServeSettings(num_workers=2), [])
    assert [c.env["VLLM_CPU_OMP_THREADS_BIND"] for c in children] == ["0,1", "2,3"]


def test_a_single_cpu_worker_computes_on_every_core(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    two_cores_no_gpu(monkeypatch)
    with caplog.at_level("INFO", logger="serve"):
        (child,) = plan.plan_workers(ServeSettings(), [])
    # vLLM binds its threads itself, with no core held back for its front end.
    assert "VLLM_CPU_OMP_THREADS_BIND" not in child.env
    assert child.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert (
        "CPU layout, 2 usable cores: worker-0 on cores all 2 (reserved for its front end: 0)"
        in caplog.text
    )


def test_the_environment_wins_over_the_cpu_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    (child,) = plan.plan_workers(ServeSettings(), [])
    assert child.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def test_gpu_device_without_gpus_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit, match="GPU"):
        plan.plan_workers(ServeSettings(device="gpu"), [])


def test_worker_metrics_ports_follow_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    children = plan.plan_workers(ServeSettings(worker_metrics_port=8100), [])
    ports = [c.argv[c.argv.index("--metrics-port") + 1] for c in children]
    assert ports == ["8100", "8101"]


POOLS = """\
pools:
  - {name: small, served_model_name: s, engine_args: [--dtype, bfloat16], devices: ["0"]}
  - {name: big, model: /models/big, workers: 2, tier: 2}
"""


def test_pools_get_their_models_flags_and_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(plan.os, "sched_getaffinity", lambda _pid: {0, 1, 2})
    children = plan.plan_pool_workers(ServeSettings(), config.parse(POOLS), ["--enforce-eager"])
    assert [c.name for c in children] == ["small-worker-0", "big-worker-1", "big-worker-2"]
    small, big, _ = children
    # The command line's flags first, the pool's after (so the pool's win).
    assert small.argv[small.argv.index("--enforce-eager") :] == [
        "--enforce-eager",
        "--served-model-name",
        "s",
        "--dtype",
        "bfloat16",
    ]
    assert big.argv[-4:] == ["--served-model-name", "big", "--model", "/models/big"]
    assert [c.argv[c.argv.index("--pool") + 1] for c in children] == ["small", "big", "big"]
    # Declared cores as given; the other pools' workers split what is left.
    assert [c.env["VLLM_CPU_OMP_THREADS_BIND"] for c in children] == ["0", "1", "2"]
    binds = [c.argv[c.argv.index("--bind") + 1] for c in children]
    assert binds == [f"tcp://127.0.0.1:{5550 + i}" for i in range(3)]


def test_a_lone_unpinned_pool_worker_computes_on_every_core(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The pools' planner gives a CPU worker the same default as ``plan_workers``."""
    two_cores_no_gpu(monkeypatch)
    with caplog.at_level("INFO", logger="serve"):
        (child,) = plan.plan_pool_workers(
            ServeSettings(), config.parse("pools:\n  - {name: only}\n"), []
        )
    assert "VLLM_CPU_OMP_THREADS_BIND" not in child.env
    assert child.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert (
        "CPU layout, 2 usable cores: only-worker-0 on cores all 2 (reserved for its front end: 0)"
        in caplog.text
    )


def test_pool_devices_are_gpu_ids_on_a_gpu_box(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    children = plan.plan_pool_workers(ServeSettings(), config.parse(POOLS), [])
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children] == ["0", "1", "2"]


def test_a_bad_config_is_one_clear_error_and_starts_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "pools.yaml"
    bad.write_text("pools:\n  - name: small\n    workers: two\n")
    done = subprocess.run(
        [sys.executable, "-m", "serve", "--config", str(bad)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert f"{bad}:3: pools[0].workers: Expected int, got str" in done.stderr
    assert "starting" not in done.stderr  # no worker, no gateway


def test_gateway_settings_go_to_the_gateway_and_engine_flags_to_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``llmgate serve --policy prefix`` once handed ``--policy`` to the worker as an
    engine flag (which it refused); the gateway's settings are serve's flags now."""
    from gateway.main import build_parser as gateway_parser

    two_cores_no_gpu(monkeypatch)
    argv = ["--policy", "prefix", "--drain-timeout", "60", "--protect-metrics", "--dtype", "half"]
    namespace, engine_args = serve_main.build_parser().parse_known_args(argv)
    worker, gateway = plan.plan_children(ServeSettings(), namespace, engine_args)
    # The gateway gets what it was given, in a form its own parser reads back.
    given = gateway.argv[gateway.argv.index("gateway.main") + 1 :]
    parsed = gateway_parser().parse_args(given)
    assert (parsed.policy, parsed.drain_timeout, parsed.protect_metrics) == ("prefix", 60.0, True)
    assert not hasattr(parsed, "heartbeat_interval")  # not given: its env or default rules
    # A worker gets the engine flags and the drain setting it has too; no routing policy.
    assert worker.argv[-3:] == ["--drain-timeout=60.0", "--dtype", "half"]
    assert not any("policy" in arg for arg in worker.argv)
    assert sorted(plan.SHARED_FLAGS) == ["drain_timeout", "heartbeat_interval"]


def test_api_keys_given_to_serve_stay_out_of_its_log() -> None:
    """The launcher logs each child's command line; the gateway's keys are in it."""
    namespace, _ = serve_main.build_parser().parse_known_args(["--api-keys", "sk-1,sk-2"])
    (flag,) = settings.given_flags(namespace, plan.GATEWAY_FLAGS)
    assert children.redacted(["gateway.main", flag, "--port", "1"]) == [
        "gateway.main",
        "--api-keys=***",
        "--port",
        "1",
    ]
    assert children.redacted(["--api-keys", "sk-1", "--policy", "prefix"]) == [
        "--api-keys",
        "***",
        "--policy",
        "prefix",
    ]


def test_urls_and_engine_secrets_in_a_logged_command_line_are_hidden() -> None:
    argv = [
        *("--state-db=postgresql://app:db-pw@db/llmgate", "--limits", "redis://:redis-pw@r:6379/0"),
        *("--hf-token", "hf_secret", "--hf-token", "--model", "m", "--policy=prefix"),
    ]
    assert children.redacted(argv) == [
        *("--state-db=postgresql://app:***@db/llmgate", "--limits", "redis://:***@r:6379/0"),
        *("--hf-token", "***", "--hf-token", "--model", "m", "--policy=prefix"),
    ]


SECRETS = {
    "LLMGATE_API_KEYS": "sk-secret-1,sk-secret-2",
    "LLMGATE_STATE_DB": "postgresql://app:db-secret@db:5432/llmgate",
    "LLMGATE_LIMITS": "redis://:limits-secret@redis:6379/1",
    "LLMGATE_CACHE": "redis://:cache-secret@redis:6379/0",
    "LLMGATE_OTLP_ENDPOINT": "http://collector:4317",
}


def test_secrets_reach_the_gateway_in_its_environment_never_a_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any user of the machine can read a command line (/proc/PID/cmdline), and
    serve logs its children's: the API keys and the stores' URLs are not on them."""
    from gateway.main import build_parser as gateway_parser

    two_cores_no_gpu(monkeypatch)
    for name in SECRETS:
        monkeypatch.delenv(name, raising=False)
    argv = [
        *("--api-keys", SECRETS["LLMGATE_API_KEYS"], "--state-db", SECRETS["LLMGATE_STATE_DB"]),
        *("--limits", SECRETS["LLMGATE_LIMITS"], "--cache", SECRETS["LLMGATE_CACHE"]),
        *("--otlp-endpoint", SECRETS["LLMGATE_OTLP_ENDPOINT"], "--policy", "prefix"),
    ]
    namespace, engine_args = serve_main.build_parser().parse_known_args(argv)
    serve = settings.from_namespace(ServeSettings, namespace)
    worker, gateway = plan.plan_children(serve, namespace, engine_args)
    for child in (worker, gateway):
        assert not any("secret" in arg for arg in child.argv), child.argv
    assert {name: gateway.env[name] for name in SECRETS} == SECRETS
    # The worker gets none of them (its vLLM traces go to the collector, a flag).
    assert not any(name in worker.env for name in SECRETS)
    assert worker.argv[worker.argv.index("--otlp-traces-endpoint") + 1] == "http://collector:4317"
    # The gateway reads them as it would its flags; the others are still flags.
    for name, value in gateway.env.items():
        if name.startswith(settings.ENV_PREFIX):
            monkeypatch.setenv(name, value)
    given = gateway.argv[gateway.argv.index("gateway.main") + 1 :]
    read = settings.from_namespace(settings.GatewaySettings, gateway_parser().parse_args(given))
    assert read.tenants.api_keys == SECRETS["LLMGATE_API_KEYS"]
    assert (read.store.state_db, read.tenants.limits, read.caching.cache) == (
        SECRETS["LLMGATE_STATE_DB"],
        SECRETS["LLMGATE_LIMITS"],
        SECRETS["LLMGATE_CACHE"],
    )
    assert (read.observability.otlp_endpoint, read.routing.policy) == (
        "http://collector:4317",
        "prefix",
    )


def test_a_flag_given_to_serve_wins_over_its_environment_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    two_cores_no_gpu(monkeypatch)
    monkeypatch.setenv("LLMGATE_STATE_DB", "postgresql://old@db/old")
    namespace, _ = serve_main.build_parser().parse_known_args(
        ["--state-db", "postgresql://new@db/new"]
    )
    *_, gateway = plan.plan_children(ServeSettings(), namespace, [])
    assert gateway.env["LLMGATE_STATE_DB"] == "postgresql://new@db/new"
    # Not given: serve's environment reaches the gateway as it is.
    namespace, _ = serve_main.build_parser().parse_known_args([])
    *_, gateway = plan.plan_children(ServeSettings(), namespace, [])
    assert gateway.env["LLMGATE_STATE_DB"] == "postgresql://old@db/old"


def test_a_collector_url_with_a_password_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """It would be on the workers' command lines: vLLM takes it as a flag only."""
    two_cores_no_gpu(monkeypatch)
    namespace, _ = serve_main.build_parser().parse_known_args([])
    with pytest.raises(SystemExit, match="OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        plan.plan_children(
            ServeSettings.of(otlp_endpoint="http://u:pw@collector:4318"), namespace, []
        )


def test_only_exact_serve_flags_are_serves() -> None:
    """An abbreviation goes to the workers verbatim (there it may be a whole engine flag)."""
    namespace, engine_args = serve_main.build_parser().parse_known_args(["--pol", "prefix"])
    assert engine_args == ["--pol", "prefix"] and not hasattr(namespace, "policy")


def test_serve_does_not_take_the_gateways_worker_addresses() -> None:
    """serve computes them from the workers it starts."""
    _namespace, engine_args = serve_main.build_parser().parse_known_args(["--workers", "tcp://x:1"])
    assert engine_args == ["--workers", "tcp://x:1"]


@pytest.mark.parametrize(
    ("code", "ever_ready", "ends_serve"),
    [
        (2, False, True),  # argparse's usage error, or settings refused
        (2, True, True),  # a worker parses its flags after importing vLLM: still one
        (1, False, True),  # any exit before it served, however long it tried
        (0, False, True),
        (1, True, False),  # a crash: restarted with backoff
        (0, True, False),
        (-9, False, False),  # killed by someone: it may well start next time
    ],
)
def test_what_ends_serve_instead_of_a_restart(
    code: int, ever_ready: bool, ends_serve: bool
) -> None:
    assert supervisor.failed_at_start(code, ever_ready) is ends_serve


def test_another_program_on_a_childs_port_does_not_make_it_ready() -> None:
    """Only the child's own listening socket counts (a second serve on the same
    port must not take the first one's gateway for its own)."""
    with socket.create_server(("127.0.0.1", 0)) as other:
        child = children.Child(
            name="sleeper",
            argv=[sys.executable, "-c", "import time; time.sleep(300)"],
            env={},
            port=other.getsockname()[1],
        )
        child.start()
        try:
            assert not child.check_ready() and not child.ever_ready
        finally:
            child.signal_group(signal.SIGKILL)
            assert child.proc is not None
            child.proc.wait(timeout=60)


# A launcher around small stand-in children (Python one-liners, with their
# port as argument): the Supervisor's own behaviour, in a process of its own
# (it takes signals and becomes a subreaper).
SUPERVISE = """\
import json, sys
from shared.logs import setup_logging
from shared.settings import ServeSettings
from serve import children, supervisor

setup_logging("info")
started = [
    children.Child(
        name=f"child-{i}",
        argv=[sys.executable, "-c", code, str(port), *args],
        env={},
        port=port,
    )
    for i, (code, port, args) in enumerate(json.loads(sys.argv[1]))
]
sys.exit(supervisor.Supervisor(ServeSettings(), started).run())
"""
ROOT = Path(__file__).resolve().parents[2]


def supervise(*children: str | tuple[str, ...]) -> subprocess.Popen[str]:
    """A launcher of ``children``: each its code, or its code and arguments."""
    specs = []
    for child in children:
        code, *args = (child,) if isinstance(child, str) else child
        specs.append((code, free_port(), args))
    return subprocess.Popen(
        [sys.executable, "-c", SUPERVISE, json.dumps(specs)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


# A child that serves: it listens on its port (its first argument), then
# exits 1 once the file named by its second argument exists.
SERVES_THEN_CRASHES = """\
import os, socket, sys, time
listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
sys.exit(1)
"""


class Output:
    """A process's output lines as they come, read by a thread of their own."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout or []:
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float = 60) -> None:
        """Until a line holds ``text``; fails after ``timeout`` (a hang guard)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.seen):
            try:
                self.seen.append(self.lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(f"no {text!r} within {timeout}s:\n" + "".join(self.seen))

    def rest(self) -> str:
        self.reader.join()
        return "".join(self.seen) + "".join(self.lines.queue)


def stop(proc: subprocess.Popen[str], output: Output) -> None:
    """SIGTERM the supervisor; fails if it has not stopped within 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the supervisor did not stop within 60 s of SIGTERM:\n" + output.rest())


def finish(proc: subprocess.Popen[str], waiting_for: str, timeout: float = 60) -> str:
    """The supervisor's whole output once it exits; fails after ``timeout``."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # it stops its children
        output = proc.communicate(timeout=60)[0]
        pytest.fail(f"the supervisor did not exit within {timeout}s ({waiting_for}):\n{output}")


@pytest.mark.parametrize(
    "refusing",
    [
        "import sys; print('bad --thing: no such file', file=sys.stderr); sys.exit(2)",
        # Another status, before it was ever ready.
        "import sys; sys.exit('bad --thing: no such file')",
        # The same, after more than the 2 s that once told a failed start.
        "import sys, time; time.sleep(3); sys.exit('bad --thing: no such file')",
    ],
)
def test_a_child_that_fails_its_start_stops_everything_with_its_message(
    refusing: str, tmp_path: Path
) -> None:
    marker = f"sleeper-{tmp_path.name}"
    sleeper = f"import time; time.sleep(300)  # {marker}"
    proc = supervise(sleeper, refusing)
    output = finish(proc, "the refusing child's exit should end it")
    assert proc.returncode != 0, output
    # Its message ends the output, and it was not restarted.
    assert output.rstrip().endswith("    bad --thing: no such file"), output
    assert "Its last lines:" in output and "restart 1 in" not in output, output
    # (``info``: a zombie anywhere on the machine has no command line to read.)
    processes = psutil.process_iter(["cmdline"])
    left = [p.pid for p in processes if marker in " ".join(p.info["cmdline"] or [])]
    assert not left, f"the other child outlived the launcher:\n{output}"


def test_a_child_that_crashes_after_it_was_ready_is_restarted(tmp_path: Path) -> None:
    crash = tmp_path / "crash"
    proc = supervise((SERVES_THEN_CRASHES, str(crash)))
    output = Output(proc)
    try:
        output.wait_for("child-0 is ready: it listens on port")
        crash.touch()
        # Its restarts crash too (at once, ready or not): a child that has
        # served is restarted, however its next start goes.
        output.wait_for("restart 2 in")
    finally:
        stop(proc, output)
    text = output.rest()
    assert proc.returncode == 0, text
    assert "child-0 exited with 1 after" in text and "restart 1 in 2s" in text, text
    assert "Its last lines:" not in text, text


def test_cpu_workers_preload_what_vllms_cpu_guide_recommends_when_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    two_cores_no_gpu(monkeypatch)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    iomp = tmp_path / "libiomp5.so"
    iomp.write_bytes(b"")
    monkeypatch.setattr(plan, "IOMP", iomp)
    monkeypatch.setattr(plan.ctypes.util, "find_library", lambda name: f"lib{name}.so.4")
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    (child,) = plan.plan_workers(ServeSettings(cpu_preload=True), [])
    assert child.env["LD_PRELOAD"] == f"libtcmalloc_minimal.so.4:{iomp}"
    assert child.env["KMP_BLOCKTIME"] == "0"
    # Off by default, and none of it where nothing is installed.
    (child,) = plan.plan_workers(ServeSettings(), [])
    assert "LD_PRELOAD" not in child.env
    monkeypatch.setattr(plan, "IOMP", tmp_path / "missing.so")
    monkeypatch.setattr(plan.ctypes.util, "find_library", lambda name: None)
    (child,) = plan.plan_workers(ServeSettings(cpu_preload=True), [])
    assert "LD_PRELOAD" not in child.env


def test_an_ld_preload_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    two_cores_no_gpu(monkeypatch)
    monkeypatch.setenv("LD_PRELOAD", "/opt/mine.so")
    (child,) = plan.plan_workers(ServeSettings(cpu_preload=True), [])
    assert child.env["LD_PRELOAD"] == "/opt/mine.so"
