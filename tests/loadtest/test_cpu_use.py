"""``loadtest.cpu_use``: which kind a process is, and cores from two snapshots."""

from __future__ import annotations

import os

import pytest

from loadtest import cpu_use
from loadtest.cpu_use import Snapshot


@pytest.mark.parametrize(
    ("title", "kind"),
    [
        ("VLLM::EngineCore ", "vLLM engine"),
        ("VLLM::Worker ", "vLLM engine"),
        ("python /x/.venv/bin/python -m worker.main --bind tcp://127.0.0.1:5", "llmgate worker"),
        ("python python -m gateway.main --workers tcp://a", "llmgate gateway"),
        ("python python -m serve --port 8000", "llmgate launcher"),
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
    before = Snapshot({1: ("vLLM engine", 10.0), 2: ("bench client", 1.0)}, idle_s=100.0, at=5.0)
    after = Snapshot(
        {
            1: ("vLLM engine", 28.0),
            2: ("bench client", 2.0),
            3: ("llmgate worker", 1.0),  # started in the window: counted from zero
        },
        idle_s=101.0,
        at=15.0,
    )
    cores = cpu_use.cores_by_kind(before, after)
    assert cores == {
        "vLLM engine": 1.8,
        "bench client": 0.1,
        "llmgate worker": 0.1,
        "idle": 0.1,
    }
    assert list(cores) == [
        "vLLM engine",
        "bench client",
        "llmgate worker",
        "idle",
    ]  # most first
    assert cpu_use.format_cores(cores).startswith("vLLM engine 1.80, ")


def test_a_snapshot_of_this_machine_finds_this_process() -> None:
    snap = cpu_use.snapshot()
    assert snap.processes[os.getpid()][0] == "bench client"
    assert snap.idle_s > 0


def test_a_process_without_a_known_title_counts_as_its_nearest_known_ancestor() -> None:
    processes = {
        10: ("python -m loadtest.bench", 1),  # the client
        11: ("python -m worker.main --bind x", 10),
        12: ("VLLM::EngineCore", 11),
        13: ("python -c from multiprocessing.spawn import spawn_main", 12),  # computes
        14: ("python -c from multiprocessing.resource_tracker import main", 11),
        15: ("python -c something the client started", 10),
        16: ("sshd", 1),
    }
    kinds = cpu_use.kinds_by_ancestry(processes, client_pid=10)
    assert kinds == {
        10: "bench client",
        11: "llmgate worker",
        12: "vLLM engine",
        13: "vLLM engine",
        14: "llmgate worker",
        15: "other processes",  # the client's own children are not the client
        16: "other processes",
    }
