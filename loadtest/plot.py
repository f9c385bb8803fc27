"""The sweep plot: throughput and p50/p99 latency against concurrent users."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtest.locust_runs import Summary

# The seed scenario sends the sweep's request, so its point belongs on the curve.
SEED_REQUEST_SCENARIOS = ("seed", "sweep")


def sweep_points(rows: Sequence[Summary]) -> list[Summary]:
    """Runs of the seed request, by users; ``[]`` when fewer than two user counts."""
    points = sorted(
        (r for r in rows if r.scenario in SEED_REQUEST_SCENARIOS and r.requests),
        key=lambda r: r.users,
    )
    return points if len({r.users for r in points}) >= 2 else []


def plot_sweep(rows: Sequence[Summary], path: Path, title: str = "") -> bool:
    """Write the PNG to ``path``; False (and no file) when there is no sweep to plot."""
    points = sweep_points(rows)
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    users = [r.users for r in points]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 6.5))
    top.plot(users, [r.requests_per_s for r in points], "o-", color="tab:blue")
    top.set_ylabel("requests/s")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    top.set_title(title or "seed request: throughput and latency vs users")
    for quantile, style in (("p50", "o-"), ("p99", "s--")):
        values = [getattr(r, f"{quantile}_ms") for r in points]
        bottom.plot(
            [u for u, v in zip(users, values, strict=True) if v is not None],
            [v / 1000 for v in values if v is not None],
            style,
            label=f"{quantile} latency",
        )
    bottom.set_ylabel("latency (s)")
    bottom.set_xlabel("concurrent users (closed loop)")
    bottom.set_ylim(bottom=0)
    bottom.set_xticks(users)
    bottom.grid(True, alpha=0.3)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
