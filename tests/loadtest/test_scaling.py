"""``loadtest.scaling``'s arithmetic on made-up figures; the measuring is a
run of ``make bench-scaling``, not a test."""

from __future__ import annotations

import argparse

import pytest

from loadtest import scaling
from loadtest.scaling import Row


def row(table: str, workers: int, processes: int, tokens_per_s: float) -> Row:
    return Row(
        table=table,
        workers=workers,
        processes=processes,
        connections=16 * workers,
        token_interval_ms=20.0,
        requests_per_s=tokens_per_s / 32,
        tokens_per_s=tokens_per_s,
        p50_ms=1.0,
        p99_ms=2.0,
        errors=0,
        gateway_cpu_util=0.5,
        workers_cpu_util=0.2,
        wrk_cpu_util=0.1,
        other_cpu_util=0.0,
    )


def test_efficiency_is_over_n_times_the_same_tables_one_worker() -> None:
    rows = scaling.with_efficiency(
        [
            row("paced", 1, 1, 800),
            row("paced", 4, 1, 3040),
            row("paced", 1, 2, 700),
            row("paced", 2, 2, 1400),
            row("flat out", 1, 1, 9000),  # flat out: the workers are not the limit
            row("flat out", 2, 1, 9000),
        ]
    )
    assert [r.efficiency for r in rows] == [1.0, 0.95, 1.0, 1.0, None, None]


def test_layouts_always_measure_one_worker_first() -> None:
    args = scaling.build_parser().parse_args(["--workers", "4,2", "--processes", "1"])
    chosen = scaling.layouts(args)
    paced = [(x.workers, x.connections) for x in chosen if x.table == "paced"]
    assert paced == [(1, 16), (2, 32), (4, 64)]
    flat = [x for x in chosen if x.table == "flat out"]
    assert [x.token_interval_ms for x in flat] == [0.0, 0.0, 0.0]


def test_saturation_names_the_best_flat_out_run_per_process_count() -> None:
    rows = [row("flat out", 1, 1, 5000), row("flat out", 4, 1, 8000), row("paced", 8, 1, 9e9)]
    (line,) = scaling.saturation(rows)
    assert "at most 8,000 streamed tokens/s" in line and "(N=4)" in line


def test_the_table_is_markdown_with_a_dash_for_no_efficiency() -> None:
    text = scaling.format_table([row("flat out", 2, 1, 100)])
    header, rule, line = text.splitlines()
    assert header.startswith("| table | P | N |") and rule.startswith("|---|")
    assert "| - |" in line


def test_no_worker_counts_is_refused() -> None:
    args = argparse.Namespace(workers="", processes="1", flat=True)
    with pytest.raises(SystemExit, match="positive"):
        scaling.layouts(args)
