"""``loadtest.fleet``'s parts on made-up figures; the measuring is a run of
``make bench ARGS="--scenario fleet"``, not a test."""

from __future__ import annotations

import argparse

import pytest

from loadtest import fleet

ARGS = argparse.Namespace(agents=2, users=4, turns=4, hot_requests=50, max_tokens=4)


def stats(
    requests: list[int], prompt: int, cached: int, floor: int, held: list[float] | None = None
) -> dict:
    share = len(requests)
    held = held or [float(n) for n in requests]
    return {
        "engines": [
            {
                "requests": n,
                "prompt_tokens": prompt // share,
                "cached_tokens": cached // share,
                "held_seconds": s,
            }
            for n, s in zip(requests, held, strict=True)
        ],
        "floor_tokens": floor,
    }


def test_a_runs_figures_come_from_the_engines_counts() -> None:
    counts = stats([10, 30], 4000, 3000, 800, held=[3.0, 1.0])
    result = fleet.summarize("rag", "kv", 8, counts, [5.0, 9.0], 1, 2.0)
    assert result.computed_tokens == 1000
    assert result.against_floor == pytest.approx(1.25)
    assert result.hit_rate == pytest.approx(0.75)
    # The engine with more requests held them for less time: load is the time held.
    assert result.busiest_against_mean == pytest.approx(1.5)
    assert result.busiest_load_against_mean == pytest.approx(1.5)
    assert (result.requests, result.errors) == (40, 1)


def test_verdicts_read_the_kv_rows_against_the_targets() -> None:
    rows = [
        fleet.summarize("agents", "kv", 1, stats([10, 10], 1000, 500, 480), [], 0, 1.0),
        fleet.summarize("agents", "kv", 8, stats([10, 10], 1000, 450, 480), [], 0, 1.0),
        fleet.summarize("hot", "kv", 1, stats([10, 30], 1000, 500, 500), [], 0, 1.0),
        fleet.summarize("hot", "kv", 8, stats([30, 10], 1000, 500, 500, [1.0, 1.2]), [], 0, 1.0),
        fleet.summarize("rag", "prefix", 1, stats([10, 10], 1000, 0, 100), [], 0, 1.0),
    ]
    lines = fleet.verdicts(rows)
    assert "agents, 1 gateway(s): kv computes 1.04x the floor (target <= 1.15): met" in lines
    assert any(line.startswith("hot, 1") and line.endswith("NOT met") for line in lines)
    # Busiest by requests (1.5x) but not by load (1.09x): load is what counts.
    assert "hot, 8 gateway(s): busiest engine's load 1.09x the mean (target <= 1.3): met" in lines
    # 450 / 500 of the tokens hit at 8 gateways against 1: 0.90.
    assert "agents: hit rate at 8 gateways / at 1: 0.90 (target >= 0.95): NOT met" in lines
    assert not any("prefix" in line for line in lines)


def test_the_workloads_share_what_they_are_meant_to() -> None:
    users = fleet.agents(ARGS, "t")
    assert len(users) == 4 and all(len(turns) == 4 for turns in users)
    # Users 0 and 2 share agent 0's instructions; each turn extends its history.
    assert users[0][0].messages[0] == users[2][0].messages[0] != users[1][0].messages[0]
    assert users[0][1].messages[:2] == users[0][0].messages
    questions = fleet.rag(ARGS, "t", cache_tokens=30_000)
    documents = {q[0].messages[0]["content"] for q in questions}
    assert len(questions) == 4 * len(documents) == 40
    hot = fleet.hot(ARGS, "t")
    systems = [r[0].messages[0]["content"] for r in hot]
    most = max(set(systems), key=systems.count)
    assert 0.6 < systems.count(most) / len(systems) < 1.0
