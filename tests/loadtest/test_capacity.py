"""loadtest/capacity.py: the soak's arithmetic and the scenarios' wiring (no server)."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from loadtest import capacity, loadtest


def test_slope_is_megabytes_per_hour() -> None:
    flat = [(t, 100.0) for t in range(0, 600, 10)]
    assert capacity.slope_mb_per_hour(flat) == 0
    growing = [(t, 100.0 + t / 60) for t in range(0, 600, 10)]  # 1 MB a minute
    assert capacity.slope_mb_per_hour(growing) == pytest.approx(60.0)
    assert capacity.slope_mb_per_hour([(0, 1.0), (10, 2.0)]) is None  # too few points


def test_totals_add_the_processes_of_a_role_at_one_time() -> None:
    samples = [
        capacity.ProcessSample(0.0, "gateway", 1, 50.0, 20),
        capacity.ProcessSample(0.0, "worker", 2, 900.0, 80),
        capacity.ProcessSample(0.0, "worker", 3, 100.0, 10),
        capacity.ProcessSample(10.0, "worker", 2, 901.0, 80),
    ]
    assert capacity.total(samples, "worker", 0.0) == (1000.0, 90)
    assert capacity.total(samples, "gateway", 10.0) == (0.0, 0)


def test_a_family_sets_vllms_engine_processes_apart_when_asked() -> None:
    """vLLM names its engine processes ``VLLM::...`` (argv[0]): a shell here with
    one child named so."""
    shell = subprocess.Popen(["bash", "-c", "(exec -a VLLM::EngineCore sleep 60) & wait"])
    try:
        root = psutil.Process(shell.pid)
        wait = time.monotonic() + 30
        while [p.cmdline()[:1] for p in root.children()] != [["VLLM::EngineCore"]]:
            assert time.monotonic() < wait, [p.cmdline() for p in root.children()]
            time.sleep(0.05)
        [engine] = root.children()
        split = capacity.process_family("worker", root, split_engine=True)
        assert {k: [p.pid for p in v] for k, v in split.items()} == {
            "worker": [root.pid],
            "worker/VLLM::EngineCore": [engine.pid],
        }
        whole = capacity.process_family("worker", root)
        assert {k: [p.pid for p in v] for k, v in whole.items()} == {
            "worker": [root.pid, engine.pid]
        }
    finally:
        for proc in psutil.Process(shell.pid).children(recursive=True):
            proc.kill()
        shell.kill()
        shell.wait()


def test_no_server_on_a_port_means_no_processes_to_sample() -> None:
    assert capacity.server_pid_of("http://127.0.0.1:1") is None
    assert capacity.server_processes(None) == {}


@pytest.mark.parametrize("scenario", loadtest.CAPACITY_SCENARIOS)
def test_the_scenarios_are_make_loadtest_choices_but_not_part_of_all(scenario: str) -> None:
    args = loadtest.build_parser().parse_args(["--scenario", scenario])
    assert args.scenario == scenario
    assert scenario not in loadtest.SCENARIOS
    defaults = loadtest.build_parser().parse_args([])
    assert (defaults.connections, defaults.soak_duration) == (1000, 1800.0)
