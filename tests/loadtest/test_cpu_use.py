"""``loadtest.cpu_use``: which kind a process is, and cores from two snapshots."""

from __future__ import annotations

import os

import pytest

from loadtest import cpu_use
from loadtest.cpu_use import Snapshot


@pytest.mark.parametrize(
    ("title", "kind"),
    [
        ("VLLM::EngineCore ", "vLLM engine core"),
        ("python /x/.venv/bin/python -m worker.main --bind tcp://127.0.0.1:5", "llmgate worker"),
        ("python python -m gateway.main --workers tcp://a", "llmgate gateway"),
        ("python python -m worker.launcher --port 8000", "llmgate launcher"),
        ("python python -m vllm.entrypoints.openai.api_server --model m", "vLLM API server"),
        ("vllm-router vllm-router --port 1", "vllm-router"),
        ("python python -m loadtest.baselines.fastapi_batching", "fastapi baseline"),
        ("sshd sshd: root", "other processes"),
    ],
)
def test_processes_are_told_apart_by_title(title: str, kind: str) -> None:
    assert cpu_use.kind_of(title, client_pid=1, pid=2) == kind


def test_the_client_is_the_bench_process_whatever_its_title() -> None:
    assert cpu_use.kind_of("python -m gateway.main", client_pid=7, pid=7) == "bench client"


def test_cores_are_cpu_seconds_over_the_window_by_kind() -> None:
    before = Snapshot({1: ("vLLM engine core", 10.0), 2: ("bench client", 1.0)}, idle_s=100.0)
    after = Snapshot(
        {
            1: ("vLLM engine core", 28.0),
            2: ("bench client", 2.0),
            3: ("llmgate worker", 1.0),  # started in the window: counted from zero
        },
        idle_s=101.0,
    )
    cores = cpu_use.cores_by_kind(before, after, seconds=10.0)
    assert cores == {
        "vLLM engine core": 1.8,
        "bench client": 0.1,
        "llmgate worker": 0.1,
        "idle": 0.1,
    }
    assert list(cores) == [
        "vLLM engine core",
        "bench client",
        "llmgate worker",
        "idle",
    ]  # most first
    assert cpu_use.format_cores(cores).startswith("vLLM engine core 1.80, ")


def test_a_snapshot_of_this_machine_finds_this_process() -> None:
    snap = cpu_use.snapshot()
    assert snap.processes[os.getpid()][0] == "bench client"
    assert snap.idle_s > 0
