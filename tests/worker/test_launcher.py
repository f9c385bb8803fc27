"""The launcher's plan: how many workers, on which devices and cores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shared import config
from shared.settings import ServeSettings
from worker import launcher


def two_cores_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only machine with cores 0 and 1, no vLLM thread settings in the environment."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda _pid: {0, 1})


def test_cpu_cores_are_split_evenly() -> None:
    assert launcher.cpu_slices(2, [0, 1, 2, 3]) == ["0,1", "2,3"]
    assert launcher.cpu_slices(3, [0, 1, 2, 3, 4, 5, 6]) == ["0,1", "2,3", "4,5"]


def test_more_workers_than_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="cores"):
        launcher.cpu_slices(3, [0, 1])


def test_one_worker_per_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    children = launcher.plan_workers(ServeSettings(), ["--model", "x"])
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children] == ["0", "1", "2"]
    assert all(c.argv[-2:] == ["--model", "x"] for c in children)
    binds = [c.argv[c.argv.index("--bind") + 1] for c in children]
    assert binds == ["tcp://127.0.0.1:5550", "tcp://127.0.0.1:5551", "tcp://127.0.0.1:5552"]


def test_cpu_workers_are_pinned_to_their_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    children = launcher.plan_workers(ServeSettings(num_workers=2), [])
    assert [c.env["VLLM_CPU_OMP_THREADS_BIND"] for c in children] == ["0,1", "2,3"]


def test_a_single_cpu_worker_computes_on_every_core(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    two_cores_no_gpu(monkeypatch)
    with caplog.at_level("INFO", logger="llmgate.launcher"):
        (child,) = launcher.plan_workers(ServeSettings(), [])
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
    (child,) = launcher.plan_workers(ServeSettings(), [])
    assert child.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def test_gpu_device_without_gpus_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit, match="GPU"):
        launcher.plan_workers(ServeSettings(device="gpu"), [])


def test_worker_metrics_ports_follow_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    children = launcher.plan_workers(ServeSettings(worker_metrics_port=8100), [])
    ports = [c.argv[c.argv.index("--metrics-port") + 1] for c in children]
    assert ports == ["8100", "8101"]


POOLS = """\
pools:
  - {name: small, served_model_name: s, engine_args: [--dtype, bfloat16], devices: ["0"]}
  - {name: big, model: /models/big, workers: 2, tier: 2}
"""


def test_pools_get_their_models_flags_and_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda _pid: {0, 1, 2})
    children = launcher.plan_pool_workers(ServeSettings(), config.parse(POOLS), ["--enforce-eager"])
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
        (child,) = launcher.plan_pool_workers(
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
    children = launcher.plan_pool_workers(ServeSettings(), config.parse(POOLS), [])
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children] == ["0", "1", "2"]


def test_a_bad_config_is_one_clear_error_and_starts_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "pools.yaml"
    bad.write_text("pools:\n  - name: small\n    workers: two\n")
    done = subprocess.run(
        [sys.executable, "-m", "worker.launcher", "--config", str(bad)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert f"{bad}:3: pools[0].workers: Expected int, got str" in done.stderr
    assert "starting" not in done.stderr  # no worker, no gateway
