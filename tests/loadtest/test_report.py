"""The helpers every bench tool shares: the gateway readiness check and the results files."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtest.procs import healthy_workers
from loadtest.report import write_json_and_csv


def test_a_gateway_is_ready_once_enough_workers_are_healthy() -> None:
    check = healthy_workers(2)
    assert not check(httpx.Response(200, json={"ready": True, "healthy_workers": 1}))
    assert check(httpx.Response(200, json={"ready": True, "healthy_workers": 2}))
    assert not check(httpx.Response(503, json={"ready": False, "healthy_workers": 0}))


@dataclass
class Point:
    name: str
    value: float


def test_results_are_written_as_json_and_csv(tmp_path: Path) -> None:
    write_json_and_csv(tmp_path, {"title": "t"}, [Point("a", 1.5), Point("b", 2.0)])
    assert json.loads((tmp_path / "results.json").read_text()) == {"title": "t"}
    with (tmp_path / "results.csv").open() as f:
        assert list(csv.DictReader(f)) == [
            {"name": "a", "value": "1.5"},
            {"name": "b", "value": "2.0"},
        ]
