"""``loadtest.percentiles``: numpy's interpolated percentile, and the nearest
rank that picks a latency some request really had."""

from __future__ import annotations

import pytest

from loadtest.percentiles import mean, observed_percentile, percentile


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)


def test_observed_percentiles_pick_observed_values() -> None:
    values = [float(v) for v in range(1, 101)]
    assert observed_percentile(values, 0.5) in (50.0, 51.0)
    assert observed_percentile(values, 0.99) == 99.0
    assert observed_percentile([3.0], 0.99) == 3.0


def test_the_mean_of_nothing_is_none() -> None:
    assert mean([]) is None
    assert mean([1.0, 2.0]) == 1.5
