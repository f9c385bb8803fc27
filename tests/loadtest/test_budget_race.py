"""loadtest/budget_race.py: its report prints, the scenario and its flags are offered."""

from __future__ import annotations

from dataclasses import asdict

from loadtest import budget_race, loadtest


def test_the_report_is_a_table_with_the_worst_run() -> None:
    runs = [
        budget_race.Run(1, 300, 168, -132, 42, True, 7, 57, 168, True),
        budget_race.Run(2, 337, 350, 13, 42, True, 9, 55, 350, True),
    ]
    report = {
        "requests_per_run": 64,
        "gateways": 2,
        "max_tokens": 16,
        "runs": [asdict(r) for r in runs],
        "worst_overshoot": 13,
        "all_within_one_reservation": True,
        "all_counted_once": True,
    }
    text = budget_race.format_report(report)
    assert "| 1 | 300 | 168 | -132 | 42 | 7 | 57 |" in text
    assert "worst: +13 tokens past the budget" in text


def test_the_scenario_and_its_flags_are_offered() -> None:
    args = loadtest.build_parser().parse_args(["--scenario", "budget", "--race-runs", "3"])
    assert (args.scenario, args.race_runs, args.race_requests, args.race_tokens) == (
        "budget",
        3,
        64,
        16,
    )
