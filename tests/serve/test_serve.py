"""``llmgate serve``: its plan (how many workers, on which devices and cores,
with which flags) and its supervisor."""

from __future__ import annotations

import queue
import signal
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
    with caplog.at_level("INFO", logger="llmgate.launcher"):
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
    with caplog.at_level("INFO", logger="llmgate.launcher"):
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
    assert plan.SHARED_FLAGS == ["heartbeat_interval", "drain_timeout"]


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


def test_only_exact_serve_flags_are_serves() -> None:
    """An abbreviation goes to the workers verbatim (there it may be a whole engine flag)."""
    namespace, engine_args = serve_main.build_parser().parse_known_args(["--pol", "prefix"])
    assert engine_args == ["--pol", "prefix"] and not hasattr(namespace, "policy")


def test_serve_does_not_take_the_gateways_worker_addresses() -> None:
    """serve computes them from the workers it starts."""
    _namespace, engine_args = serve_main.build_parser().parse_known_args(["--workers", "tcp://x:1"])
    assert engine_args == ["--workers", "tcp://x:1"]


@pytest.mark.parametrize(
    ("code", "ran", "ends_serve"),
    [
        (2, 0.1, True),  # argparse's usage error, or settings refused
        (2, 30.0, True),  # a worker parses its flags after importing vLLM: still one
        (1, 0.5, True),  # any exit before it could serve
        (0, 0.5, True),
        (1, supervisor.EARLY_EXIT_SECONDS + 0.1, False),  # a crash: restarted with backoff
        (1, 3600.0, False),
        (-9, 0.5, False),  # killed by someone: it may well start next time
    ],
)
def test_what_ends_serve_instead_of_a_restart(code: int, ran: float, ends_serve: bool) -> None:
    assert supervisor.exited_at_once(code, ran) is ends_serve


# A launcher around small stand-in children (Python one-liners): the
# Supervisor's own behaviour, in a process of its own (it takes signals and
# becomes a subreaper).
SUPERVISE = """\
import sys
from shared.settings import ServeSettings
from serve import children, supervisor

supervisor.EARLY_EXIT_SECONDS = float(sys.argv[1])
started = [
    children.Child(name=f"child-{i}", argv=[sys.executable, "-c", code], env={})
    for i, code in enumerate(sys.argv[2:])
]
sys.exit(supervisor.Supervisor(ServeSettings(), started).run())
"""
ROOT = Path(__file__).resolve().parents[2]


def supervise(early_exit_seconds: float, *children: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SUPERVISE, str(early_exit_seconds), *children],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


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
        # Another status, but at once.
        "import sys; sys.exit('bad --thing: no such file')",
    ],
)
def test_a_child_that_exits_at_once_stops_everything_with_its_message(
    refusing: str, tmp_path: Path
) -> None:
    marker = f"sleeper-{tmp_path.name}"
    sleeper = f"import time; time.sleep(300)  # {marker}"
    # A 30 s window, not the real 2 s: the child's Python start-up, on a machine
    # that may give it a small share of a core, is not what is tested.
    proc = supervise(30, sleeper, refusing)
    output = finish(proc, "the refusing child's exit should end it")
    assert proc.returncode != 0, output
    # Its message ends the output, and it was not restarted.
    assert output.rstrip().endswith("    bad --thing: no such file"), output
    assert "Its last lines:" in output and "restart 1 in" not in output, output
    # (``info``: a zombie anywhere on the machine has no command line to read.)
    processes = psutil.process_iter(["cmdline"])
    left = [p.pid for p in processes if marker in " ".join(p.info["cmdline"] or [])]
    assert not left, f"the other child outlived the launcher:\n{output}"


def test_a_child_that_crashes_later_is_restarted() -> None:
    # It crashes 0.5 s after its start, after the (shortened) early-exit window.
    proc = supervise(0.1, "import sys, time; time.sleep(0.5); sys.exit(1)")
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stdout or []:
            lines.put(line)

    reader = threading.Thread(target=read)
    reader.start()
    seen: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while not any("restart 2 in" in line for line in seen):
            try:
                seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(
                    "no second restart of a child that crashes 0.5 s after its start "
                    "within 60 s:\n" + "".join(seen)
                )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the supervisor did not stop within 60 s of SIGTERM:\n" + "".join(seen))
        reader.join()
    output = "".join(seen) + "".join(lines.queue)
    assert proc.returncode == 0, output
    assert "child-0 exited with 1 after" in output and "restart 1 in 2s" in output, output
    assert "Its last lines:" not in output, output


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
