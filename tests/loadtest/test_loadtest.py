"""The load test runner's pure parts: the plan, Locust's command line, the summary, the plot."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import pytest

from loadtest import loadtest, locust_runs
from loadtest.locust_runs import LocustSummary, Run, Stats, Summary
from loadtest.plot import plot_sweep, sweep_points


def args(*argv: str) -> argparse.Namespace:
    return loadtest.resolve_durations(loadtest.build_parser().parse_args(list(argv)))


def test_all_scenarios_run_in_order_with_the_issues_user_counts() -> None:
    runs = locust_runs.plan_runs(args())
    assert [(r.name, r.user_class, r.users) for r in runs] == [
        ("seed", "SeedUser", 40),
        ("chat-stream", "ChatStreamUser", 40),
        ("sweep-24", "SeedUser", 24),
        ("sweep-64", "SeedUser", 64),
        ("sweep-128", "SeedUser", 128),
        ("sweep-256", "SeedUser", 256),
    ]


def test_the_default_plan_leaves_room_for_a_compiled_start_within_15_minutes() -> None:
    # A compiled llmgate start takes about 2.5 minutes on the 2-core machine.
    assert locust_runs.planned_seconds(locust_runs.plan_runs(args())) <= 10 * 60


def test_one_scenario_and_custom_sweep() -> None:
    runs = locust_runs.plan_runs(
        args("--scenario", "sweep", "--sweep-users", "2,5", "--step-duration", "7")
    )
    assert [(r.name, r.users, r.duration) for r in runs] == [
        ("sweep-2", 2, 7.0),
        ("sweep-5", 5, 7.0),
    ]


def test_sweep_users_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        args("--sweep-users", "0,4")


def test_locust_runs_headless_closed_loop_with_warmup_and_reports(tmp_path: Path) -> None:
    run = Run("sweep-64", "sweep", "SeedUser", 64, warmup=20, duration=60)
    argv = locust_runs.locust_argv(run, "http://h:1", tmp_path / "sweep-64", args("--model", "m"))
    assert argv[1:3] == ["-m", "locust"]
    assert argv[-1] == "SeedUser"

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert "--headless" in argv
    assert value("--users") == value("--spawn-rate") == "64"
    assert value("--run-time") == "80s"
    assert value("--warmup") == "20"
    assert value("--host") == "http://h:1"
    assert value("--csv") == str(tmp_path / "sweep-64")
    assert value("--html") == str(tmp_path / "sweep-64.html")
    assert value("--summary-json") == str(tmp_path / "sweep-64_summary.json")
    assert value("--model") == "m"


def test_web_mode_has_no_run_time_and_lets_the_user_pick_classes(tmp_path: Path) -> None:
    argv = locust_runs.web_argv("http://h:1", tmp_path / "web", args("--web", "--web-port", "9000"))
    assert "--headless" not in argv and "--run-time" not in argv
    assert "--class-picker" in argv
    assert argv[argv.index("--web-port") + 1] == "9000"


LOCUST_SUMMARY = {
    "window_s": 50.0,
    "entries": [
        {
            "type": "POST",
            "name": "/v1/chat/completions (stream)",
            "requests": 110,
            "failures": 10,
            "mean_ms": 5000.0,
            "p50_ms": 4900,
            "p99_ms": 6100,
        },
        {
            "type": "SSE",
            "name": "TTFT",
            "requests": 100,
            "failures": 0,
            "mean_ms": 900.5,
            "p50_ms": 880,
            "p99_ms": 1500,
        },
        {
            "type": "SSE",
            "name": "ITL",
            "requests": 6300,
            "failures": 0,
            "mean_ms": 65.25,
            "p50_ms": 64,
            "p99_ms": 90,
        },
    ],
}


def test_summary_json_is_parsed_by_request_name() -> None:
    parsed = locust_runs.parse_locust_summary(json.dumps(LOCUST_SUMMARY))
    assert parsed.window_s == 50.0
    assert parsed.stats["TTFT"] == Stats("TTFT", 100, 0, 900.5, 880, 1500)
    assert set(parsed.stats) == {"/v1/chat/completions (stream)", "TTFT", "ITL"}


def test_throughput_counts_successes_over_the_measured_window() -> None:
    run = Run("chat-stream", "chat-stream", "ChatStreamUser", 40, warmup=20, duration=60)
    row = locust_runs.summarize(run, locust_runs.parse_locust_summary(json.dumps(LOCUST_SUMMARY)))
    # 100 successes in the 50 s window Locust measured, not the 60 s planned.
    assert row.requests_per_s == pytest.approx(2.0)
    assert (row.requests, row.failures, row.p50_ms, row.p99_ms) == (110, 10, 4900, 6100)
    assert (row.ttft_mean_ms, row.itl_mean_ms, row.window_s) == (900.5, 65.25, 50.0)


def test_seed_runs_read_the_completions_row_and_have_no_ttft() -> None:
    stats = {
        "/v1/completions": Stats("/v1/completions", 300, 0, 3000.0, 3000, 3600),
        "Aggregated": Stats("Aggregated", 300, 0, 3000.0, 3000, 3600),
    }
    run = Run("seed", "seed", "SeedUser", 40, warmup=20, duration=60)
    row = locust_runs.summarize(run, LocustSummary(window_s=60.0, stats=stats))
    assert row.requests_per_s == pytest.approx(5.0)
    assert row.ttft_mean_ms is None and row.itl_mean_ms is None


def test_a_run_without_its_request_reports_zero() -> None:
    run = Run("seed", "seed", "SeedUser", 40, warmup=20, duration=60)
    row = locust_runs.summarize(run, LocustSummary(window_s=60.0, stats={}))
    assert (row.requests, row.requests_per_s, row.p50_ms) == (0, 0.0, None)


def summary(run: str, users: int, rps: float, p50: float | None = 1000.0) -> Summary:
    scenario = run.split("-")[0] if run.startswith(("seed", "sweep")) else run
    return Summary(scenario, run, users, 100, 0, rps, p50, 2000.0, window_s=60.0)


def test_table_has_a_row_per_run_and_dashes_for_what_was_not_measured() -> None:
    rows = [
        summary("seed", 40, 12.345),
        Summary("chat-stream", "chat-stream", 40, 50, 1, 0.8, 5000, 6000, 900.4, 65.25),
    ]
    lines = loadtest.format_table(rows).splitlines()
    assert lines[0].split() == [
        "run",
        "users",
        "req/s",
        "requests",
        "failures",
        "p50",
        "ms",
        "p99",
        "ms",
        "TTFT",
        "ms",
        "ITL",
        "ms",
    ]
    assert lines[1].split() == ["seed", "40", "12.35", "100", "0", "1000", "2000", "-", "-"]
    assert lines[2].split() == [
        "chat-stream",
        "40",
        "0.80",
        "50",
        "1",
        "5000",
        "6000",
        "900",
        "65.2",
    ]


def test_summary_files_hold_every_row_and_the_metadata(tmp_path: Path) -> None:
    rows = [summary("seed", 40, 12.0), summary("sweep-24", 24, 10.0)]
    loadtest.write_summary(tmp_path, {"date": "d", "model": "m"}, rows)
    with (tmp_path / "summary.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [r["run"] for r in table] == ["seed", "sweep-24"]
    assert list(table[0]) == loadtest.SUMMARY_COLUMNS
    document = json.loads((tmp_path / "summary.json").read_text())
    assert document["model"] == "m"
    assert document["results"][1]["requests_per_s"] == 10.0


def test_the_plot_puts_the_seed_run_on_the_sweep_curve_by_users() -> None:
    rows = [
        summary("sweep-64", 64, 14.0),
        summary("seed", 40, 13.0),
        Summary("chat-stream", "chat-stream", 40, 50, 0, 1.0, 5000, 6000),
        summary("sweep-24", 24, 11.0),
    ]
    assert [r.users for r in sweep_points(rows)] == [24, 40, 64]


def test_the_plot_is_written_as_png(tmp_path: Path) -> None:
    rows = [summary("sweep-24", 24, 11.0), summary("sweep-64", 64, 14.0, p50=None)]
    assert plot_sweep(rows, tmp_path / "sweep.png", title="t")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_plot_without_two_user_counts(tmp_path: Path) -> None:
    assert not plot_sweep([summary("seed", 40, 13.0)], tmp_path / "sweep.png")
    assert not (tmp_path / "sweep.png").exists()
