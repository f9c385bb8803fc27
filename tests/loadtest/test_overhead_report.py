"""``loadtest.overhead_report``: added latency, min/median/max, the issue's
targets and the table, on made-up figures."""

from __future__ import annotations

import pytest

from loadtest import overhead_report
from loadtest.overhead_report import Spread
from loadtest.wrk import Run


def _run(target: str, scenario: str, repeat: int, **figures: float) -> Run:
    base: dict[str, float] = {
        "requests_per_s": 1000.0,
        "tokens_per_s": 0.0,
        "latency_mean_us": 100.0,
        "loadgen_cpu_util": 0.1,
        "backend_cpu_util": 0.5,
        "other_cpu_util": 0.0,
    }
    base.update(figures)
    proxy: dict[str, float | None] = {}
    if target != "direct":
        proxy = {
            "proxy_cpu_util": base.pop("proxy_cpu_util", 1.0),
            "requests_per_proxy_core_s": base.pop("requests_per_proxy_core_s", 1000.0),
            "tokens_per_proxy_core_s": base.pop("tokens_per_proxy_core_s", None),
            "proxy_cpu_s_per_1k_requests": 1.0,
            "proxy_rss_mib": 50.0,
            "proxy_peak_rss_mib": 60.0,
        }
    return Run(
        target=target,
        scenario=scenario,
        repeat=repeat,
        connections=1,
        tokens_per_request=1,
        seconds=5.0,
        requests=5000,
        errors=0,
        latency_p50_us=base["latency_mean_us"],
        latency_p99_us=base["latency_mean_us"] * 2,
        latency_max_us=base["latency_mean_us"] * 3,
        **base,
        **proxy,
    )


def test_added_latency_pairs_each_proxy_with_direct_of_the_same_repeat() -> None:
    runs = [
        _run("direct", "latency", 1, latency_mean_us=100),
        _run("llmgate", "latency", 1, latency_mean_us=220),
        _run("direct", "latency", 2, latency_mean_us=140),
        _run("llmgate", "latency", 2, latency_mean_us=250),
        _run("llmgate", "throughput", 1, latency_mean_us=9999),
    ]
    assert overhead_report.added_latency(runs) == {("llmgate", 1): 120, ("llmgate", 2): 110}


def test_summarize_gives_min_median_max_over_repeats() -> None:
    runs = [_run("llmgate", "throughput", i, requests_per_s=rps) for i, rps in enumerate((3, 1, 2))]
    summary = overhead_report.summarize(runs)
    assert summary[("throughput", "llmgate")]["requests_per_s"] == Spread(1, 2, 3, 3)
    # Non-streaming runs have no tokens/s figure, and no added latency outside "latency".
    assert "tokens_per_s" not in summary[("throughput", "llmgate")]
    assert "added_latency_us" not in summary[("throughput", "llmgate")]


def _summary_for_verdicts(added: float, rps: float, tokens: float) -> list[overhead_report.Verdict]:
    runs = []
    for repeat in (1, 2, 3):
        runs += [
            _run("direct", "latency", repeat, latency_mean_us=100),
            _run("llmgate", "latency", repeat, latency_mean_us=100 + added),
            _run("vllm-router", "latency", repeat, latency_mean_us=350),
            _run(
                "llmgate", "throughput", repeat, requests_per_s=rps, requests_per_proxy_core_s=rps
            ),
            _run(
                "vllm-router",
                "throughput",
                repeat,
                requests_per_s=10_000,
                requests_per_proxy_core_s=10_000,
            ),
            _run("llmgate", "stream", repeat, tokens_per_s=tokens, tokens_per_proxy_core_s=tokens),
        ]
    return overhead_report.verdicts(overhead_report.summarize(runs))


def test_verdicts_pass_at_the_targets() -> None:
    judged = _summary_for_verdicts(added=150, rps=5000, tokens=50_000)
    assert [v.passed for v in judged] == [True, True, True, True]
    assert judged[0].note == "vllm-router adds 250"


def test_verdicts_miss_below_the_targets() -> None:
    judged = _summary_for_verdicts(added=151, rps=4999, tokens=49_999)
    assert [v.passed for v in judged] == [False, False, False, False]
    assert judged[1].measured == pytest.approx(0.4999)


def test_verdicts_without_a_router_are_not_judged() -> None:
    summary = overhead_report.summarize([_run("llmgate", "throughput", 1)])
    ratios = [v for v in overhead_report.verdicts(summary) if "vllm-router" in v.name]
    assert ratios and all(v.passed is None for v in ratios)


def test_format_table_shows_median_and_range_per_target() -> None:
    runs = [
        _run(t, "latency", r, latency_mean_us=100 + r)
        for t in ("direct", "llmgate")
        for r in (1, 2, 3)
    ]
    table = overhead_report.format_table(overhead_report.summarize(runs))
    header, *rows = table.splitlines()
    assert header.split() == ["latency", "direct", "llmgate"]
    mean_row = next(r for r in rows if "latency mean" in r)
    assert "102 [101-103]" in mean_row
