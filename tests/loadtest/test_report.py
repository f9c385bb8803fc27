"""The helpers every bench tool shares: the gateway readiness check, the results
directory and files, the printed tables."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from loadtest import report
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


def test_a_results_directory_is_named_for_the_tool_and_the_utc_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "RESULTS_ROOT", tmp_path)
    started = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert report.results_dir("bench", started) == tmp_path / "20260102T030405Z-bench"
    assert (tmp_path / "20260102T030405Z-bench").is_dir()
    chosen = tmp_path / "mine"
    assert report.results_dir("bench", started, chosen) == chosen and chosen.is_dir()


def test_a_text_table_aligns_its_columns_and_dashes_missing_figures() -> None:
    columns = (("name", "name", "{:<4}", 4), ("value", "v", "{:>6.1f}", 6))
    table = report.text_table(columns, [Point("a", 1.5), Point("b", None)])  # type: ignore[arg-type]
    assert table.splitlines() == ["name      v", "a       1.5", "b         -"]


def test_a_markdown_table_has_a_header_a_rule_and_a_line_per_row() -> None:
    table = report.markdown_table(["a", "b"], [["1", "2"]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |"]
