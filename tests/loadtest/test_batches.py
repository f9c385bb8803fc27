"""loadtest/batches.py: its input file is OpenAI's batch JSONL, and its report reads its figures."""

from __future__ import annotations

import json

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
