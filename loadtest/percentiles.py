"""Percentiles and means of measured figures, the two ways the bench tools take them."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation, as numpy's default."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def observed_percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0-1) as one of ``values`` (the nearest rank): a latency
    that some request really had."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def mean(values: Sequence[float]) -> float | None:
    """The mean; None when there are no values."""
    return sum(values) / len(values) if values else None
