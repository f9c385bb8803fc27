"""The launcher's plan: how many workers, on which devices and cores."""

from __future__ import annotations

import pytest

from shared.settings import ServeSettings
from worker import launcher


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


def test_a_single_cpu_worker_keeps_vllms_own_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    (child,) = launcher.plan_workers(ServeSettings(), [])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in child.env


def test_gpu_device_without_gpus_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit, match="GPU"):
        launcher.plan_workers(ServeSettings(device="gpu"), [])


def test_worker_metrics_ports_follow_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    children = launcher.plan_workers(ServeSettings(worker_metrics_port=8100), [])
    ports = [c.argv[c.argv.index("--metrics-port") + 1] for c in children]
    assert ports == ["8100", "8101"]
