"""The overhead harness's figures: min/median/max over the repeats, the
issue's three gateway targets judged on the medians, and the printed tables
and files (``runs.csv``, ``summary.csv``, ``results.json``)."""

from __future__ import annotations

import collections
import csv
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest.overhead_servers import TARGETS
from loadtest.report import write_csv, write_json
from loadtest.wrk import SCENARIO_NAMES, Run

# What issue 6 asks of the gateway.
TARGET_ADDED_LATENCY_US = 150.0
TARGET_RPS_VS_ROUTER = 0.5
TARGET_TOKENS_PER_CORE_S = 50_000.0

SUMMARY_COLUMNS = ("scenario", "target", "metric", "min", "median", "max", "n")
SUMMARY_METRICS = (
    "requests_per_s",
    "tokens_per_s",
    "latency_mean_us",
    "latency_p50_us",
    "latency_p99_us",
    "added_latency_us",
    "proxy_cpu_util",
    "requests_per_proxy_core_s",
    "tokens_per_proxy_core_s",
    "proxy_cpu_s_per_1k_requests",
    "proxy_peak_rss_mib",
    "backend_cpu_util",
    "loadgen_cpu_util",
    "other_cpu_util",
)


def added_latency(runs: Sequence[Run]) -> dict[tuple[str, int], float]:
    """(proxy, repeat) -> its mean latency minus ``direct``'s, latency scenario, same repeat."""
    direct = {
        r.repeat: r.latency_mean_us
        for r in runs
        if r.scenario == "latency" and r.target == "direct"
    }
    return {
        (r.target, r.repeat): r.latency_mean_us - direct[r.repeat]
        for r in runs
        if r.scenario == "latency" and r.target != "direct" and r.repeat in direct
    }


@dataclass
class Spread:
    min: float
    median: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(min(values), statistics.median(values), max(values), len(values))


def summarize(runs: Sequence[Run]) -> dict[tuple[str, str], dict[str, Spread]]:
    """(scenario, target) -> metric -> min/median/max over the repeats."""
    values: dict[tuple[str, str], dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    extra = added_latency(runs)
    for run in runs:
        row = asdict(run)
        row["added_latency_us"] = (
            extra.get((run.target, run.repeat)) if run.scenario == "latency" else None
        )
        for metric in SUMMARY_METRICS:
            value = row[metric]
            if value is not None and not (metric == "tokens_per_s" and run.scenario != "stream"):
                values[(run.scenario, run.target)][metric].append(float(value))
    return {key: {m: Spread.of(v) for m, v in by.items()} for key, by in values.items()}


@dataclass
class Verdict:
    name: str
    target: str
    measured: float | None
    passed: bool | None
    note: str = ""


def verdicts(summary: dict[tuple[str, str], dict[str, Spread]]) -> list[Verdict]:
    """The issue's three gateway targets, judged on medians."""

    def median(scenario: str, target: str, metric: str) -> float | None:
        spread = summary.get((scenario, target), {}).get(metric)
        return spread.median if spread else None

    out = []
    added = median("latency", "llmgate", "added_latency_us")
    router_added = median("latency", "vllm-router", "added_latency_us")
    out.append(
        Verdict(
            "added latency at concurrency 1 (us)",
            f"<= {TARGET_ADDED_LATENCY_US:.0f}",
            added,
            None if added is None else added <= TARGET_ADDED_LATENCY_US,
            "" if router_added is None else f"vllm-router adds {router_added:.0f}",
        )
    )
    for metric, label in (
        ("requests_per_s", "requests/s vs vllm-router"),
        ("requests_per_proxy_core_s", "requests per proxy core-second vs vllm-router"),
    ):
        ours = median("throughput", "llmgate", metric)
        theirs = median("throughput", "vllm-router", metric)
        ratio = ours / theirs if ours is not None and theirs else None
        out.append(
            Verdict(
                label,
                f">= {TARGET_RPS_VS_ROUTER:g}x",
                ratio,
                None if ratio is None else ratio >= TARGET_RPS_VS_ROUTER,
                "" if ours is None or theirs is None else f"{ours:.0f} vs {theirs:.0f}",
            )
        )
    tokens = median("stream", "llmgate", "tokens_per_proxy_core_s")
    router_tokens = median("stream", "vllm-router", "tokens_per_proxy_core_s")
    out.append(
        Verdict(
            "streamed tokens per gateway core-second",
            f">= {TARGET_TOKENS_PER_CORE_S:.0f}",
            tokens,
            None if tokens is None else tokens >= TARGET_TOKENS_PER_CORE_S,
            "" if router_tokens is None else f"vllm-router: {router_tokens:.0f}",
        )
    )
    return out


def _fmt(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_spread(spread: Spread | None) -> str:
    if spread is None:
        return "-"
    return f"{_fmt(spread.median)} [{_fmt(spread.min)}-{_fmt(spread.max)}]"


TABLE_ROWS = (
    ("requests/s", "requests_per_s"),
    ("streamed tokens/s", "tokens_per_s"),
    ("latency mean (us)", "latency_mean_us"),
    ("added latency (us)", "added_latency_us"),
    ("latency p50 (us)", "latency_p50_us"),
    ("latency p99 (us)", "latency_p99_us"),
    ("proxy CPU (cores)", "proxy_cpu_util"),
    ("requests per proxy core-s", "requests_per_proxy_core_s"),
    ("tokens per proxy core-s", "tokens_per_proxy_core_s"),
    ("proxy CPU s per 1k requests", "proxy_cpu_s_per_1k_requests"),
    ("proxy peak RSS (MiB)", "proxy_peak_rss_mib"),
    ("backend CPU (cores)", "backend_cpu_util"),
    ("wrk CPU (cores)", "loadgen_cpu_util"),
    ("other CPU (cores)", "other_cpu_util"),
)


def format_table(summary: dict[tuple[str, str], dict[str, Spread]]) -> str:
    """A block per scenario: a row per metric, a column per target; cells median [min-max]."""
    blocks = []
    for scenario in SCENARIO_NAMES:
        present = [t for t in TARGETS if (scenario, t) in summary]
        if not present:
            continue
        rows = [[scenario, *present]]
        for label, metric in TABLE_ROWS:
            cells = [format_spread(summary[(scenario, t)].get(metric)) for t in present]
            if any(cell != "-" for cell in cells):
                rows.append([f"  {label}", *cells])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        blocks.append(
            "\n".join(
                "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
                for r in rows
            )
        )
    return "\n\n".join(blocks)


def format_verdicts(items: Sequence[Verdict]) -> str:
    lines = []
    for v in items:
        state = "n/a" if v.passed is None else ("PASS" if v.passed else "MISS")
        shown = "-" if v.measured is None else _fmt(v.measured)
        note = f"  ({v.note})" if v.note else ""
        lines.append(f"{state:4}  {v.name}: {shown} (target {v.target}){note}")
    return "\n".join(lines)


def summary_entries(summary: dict[tuple[str, str], dict[str, Spread]]) -> list[dict[str, Any]]:
    """The summary as rows of ``SUMMARY_COLUMNS`` (``results.json``'s and ``summary.csv``'s)."""
    return [
        {"scenario": s, "target": t, "metric": m, **asdict(spread)}
        for (s, t), by in sorted(summary.items())
        for m, spread in by.items()
    ]


def write_results(out_dir: Path, runs: Sequence[Run], report: dict[str, Any]) -> None:
    if runs:
        write_csv(out_dir / "runs.csv", runs)
    with (out_dir / "summary.csv").open("w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(SUMMARY_COLUMNS)
        for entry in report["summary"]:
            rows.writerow([entry[k] for k in SUMMARY_COLUMNS])
    write_json(out_dir / "results.json", report)
