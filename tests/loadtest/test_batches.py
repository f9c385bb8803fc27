"""loadtest/batches.py: its input file is OpenAI's batch JSONL, and its report reads its figures."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import batches


def test_the_batch_input_is_one_request_per_line() -> None:
    bodies = [batches.sampled_body("m", i, 16) for i in range(3)]
    lines = batches.batch_input(bodies).decode().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"custom_id": f"line-{i}", "method": "POST", "url": batches.CHAT, "body": bodies[i]}
        for i in range(3)
    ]


def test_latency_stats_pick_observed_values() -> None:
    stats = batches.latency_stats([0.1 * i for i in range(1, 101)])
    assert stats["requests"] == 100
    assert round(stats["p99_s"], 6) == 9.9
    assert batches.latency_stats([])["p50_s"] is None


def test_the_report_names_each_figure() -> None:
    stats = batches.latency_stats([0.5, 0.6])
    report = {
        "interactive_idle": stats,
        "interactive_under_batch": stats,
        "p50_ratio": 1.0,
        "batch_alone": {"lines": 10, "seconds": 2.0, "lines_per_s": 5.0, "status": "completed"},
        "interactive_same_requests": {"concurrency": 4, "requests_per_s": 6.0},
        "batch_throughput_ratio": 5.0 / 6.0,
        "cache_miss": stats | {"headers": {"miss": 2}},
        "cache_hit": stats | {"headers": {"hit": 2}},
        "precompute": stats | {"headers": {"hit": 2}},
    }
    text = batches.format_report(report)
    assert "p50 x1.00 of idle" in text and "ratio 0.83" in text and "{'hit': 2}" in text


def test_completed_lines_add_up_the_completed_counter_only() -> None:
    page = (
        "# HELP llmgate_batch_lines_total Batch lines finished.\n"
        "# TYPE llmgate_batch_lines_total counter\n"
        'llmgate_batch_lines_total{status="completed"} 12.0\n'
        'llmgate_batch_lines_total{status="failed"} 3.0\n'
        "# HELP llmgate_batch_lines_created Created.\n"
        "# TYPE llmgate_batch_lines_created gauge\n"
        'llmgate_batch_lines_created{status="completed"} 1.7e9\n'
    )
    assert batches.completed_lines(page) == 12
    assert batches.completed_lines("") == 0


def test_extra_gateways_share_the_serves_state_store(tmp_path: Path) -> None:
    sqlite = batches.gateway_argv(9001, "tcp://127.0.0.1:7000", tmp_path, "")
    assert sqlite[-6:] == [
        *("--workers", "tcp://127.0.0.1:7000", "--cache", "memory"),
        *("--state-dir", str(tmp_path / "state")),
    ]
    postgres = batches.gateway_argv(9001, "tcp://127.0.0.1:7000", tmp_path, "postgresql://h/db")
    assert postgres[-2:] == ["--state-db", "postgresql://h/db"]


def test_the_report_with_two_gateways_gives_both_rates_and_the_spread() -> None:
    stats = batches.latency_stats([0.5, 0.6])
    alone = {"lines": 10, "seconds": 2.0, "lines_per_s": 5.0, "status": "completed"}
    report = {
        "interactive_idle": stats,
        "interactive_under_batch": stats,
        "p50_ratio": 1.0,
        "batch_alone": alone | {"gateways": 1, "lines_by_gateway": [10]},
        "batch_alone_spread": {
            **alone,
            "gateways": 2,
            "seconds": 1.6,
            "lines_per_s": 6.25,
            "lines_by_gateway": [6, 4],
        },
        "batch_under_load_lines_by_gateway": [5, 5],
        "interactive_same_requests": {"concurrency": 4, "requests_per_s": 6.0},
        "batch_throughput_ratio": 5.0 / 6.0,
        "cache_miss": stats | {"headers": {"miss": 2}},
        "cache_hit": stats | {"headers": {"hit": 2}},
        "precompute": stats | {"headers": {"hit": 2}},
    }
    text = batches.format_report(report)
    assert "interactive rows: requests round-robin over 2 gateways" in text
    assert "6 + 4 (completed; x1.25 of 1 gateway)" in text
    assert "lines per gateway: 5 + 5" in text


def test_one_gateway_keeps_the_single_gateway_table() -> None:
    stats = batches.latency_stats([0.5])
    report = {
        "interactive_idle": stats,
        "interactive_under_batch": stats,
        "batch_alone": {"lines": 1, "seconds": 1.0, "lines_per_s": 1.0, "status": "completed"},
        "interactive_same_requests": {"concurrency": 1, "requests_per_s": 1.0},
        "batch_throughput_ratio": 1.0,
        "cache_miss": stats | {"headers": {}},
        "cache_hit": stats | {"headers": {}},
        "precompute": stats | {"headers": {}},
    }
    text = batches.format_report(report)
    assert text.splitlines()[1].startswith("interactive, idle                        1")
    assert "gateway" not in text
