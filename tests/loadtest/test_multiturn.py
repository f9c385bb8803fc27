"""``loadtest.multiturn``'s parts on made-up figures; the measuring is a run of
``make bench ARGS="--scenario multiturn"``, not a test."""

from __future__ import annotations

import httpx
import pytest

from loadtest import multiturn
from loadtest.conversations import Turn


def test_summary_of_turns() -> None:
    turns = [
        Turn(0, 1, 0.4, 1.0, 16, worker="w0"),
        Turn(0, 2, 0.2, 0.8, 16, worker="w0", started_s=1.0),
        Turn(1, 1, None, 0.1, 0, error="HTTP 503"),
    ]
    result = multiturn.summarize("prefix", turns, 2.0, [0.5, None])
    assert result.requests_per_worker == {"w0": 2}
    assert (result.requests, result.errors) == (2, 1)
    assert result.mean_ttft_ms == pytest.approx(300)
    assert result.mean_ttft_later_turns_ms == pytest.approx(200)
    assert result.output_tokens_per_s == pytest.approx(16)
    assert result.mean_ttft_by_turn_ms == [pytest.approx(400), pytest.approx(200)]
    assert "| prefix | 300 |" in multiturn.format_table([result])


def test_verdict_compares_prefix_with_round_robin() -> None:
    prefix = multiturn.summarize("prefix", [Turn(0, 1, 0.1, 1.0, 16)], 1.0, [])
    rr = multiturn.summarize("round-robin", [Turn(0, 1, 0.2, 1.0, 16)], 1.0, [])
    line = multiturn.verdict([prefix, rr])
    assert line is not None and "2.00x" in line and line.endswith(": met")
    assert multiturn.verdict([prefix]) is None
    # Throughput within 2% is equal (the offered load is the same); below, not.
    for seconds, outcome in ((1.01, ": met"), (1.05, ": NOT met")):
        slower = multiturn.summarize("prefix", [Turn(0, 1, 0.1, 1.0, 16)], seconds, [])
        line = multiturn.verdict([slower, rr])
        assert line is not None and line.endswith(outcome), line
    worse = multiturn.summarize("prefix", [Turn(0, 1, 0.15, 1.0, 16)], 1.0, [])
    line = multiturn.verdict([worse, rr])
    assert line is not None and "1.33x" in line and line.endswith(": NOT met")


def test_prefix_counters_are_read_from_vllms_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    page = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0\n'
    )
    monkeypatch.setattr(multiturn.httpx, "get", lambda *_a, **_k: httpx.Response(200, text=page))
    assert multiturn.prefix_counters("http://worker/metrics") == (1000.0, 250.0)


def test_turns_that_moved_worker_and_the_load_each_turn_met() -> None:
    turns = [
        Turn(0, 1, 0.5, 2.0, 16, worker="a", started_s=0.0),
        Turn(1, 1, 0.5, 2.0, 16, worker="a", started_s=1.0),  # meets user 0's turn 1
        Turn(0, 2, 1.5, 2.0, 16, worker="b", started_s=3.0),  # moved: a, then b
        Turn(1, 2, 0.1, 1.0, 16, worker="a", started_s=3.5),  # stayed on a; a idle by then
    ]
    assert [(t.user, t.turn) for t in multiturn.moved(turns)] == [(0, 2)]
    assert [multiturn.load_at_send(t, turns) for t in turns] == [0, 1, 0, 0]
    result = multiturn.summarize("prefix", turns, 6.0, [])
    assert result.moved_turns == 1
    assert result.mean_ttft_moved_ms == pytest.approx(1500)
    assert result.mean_load_at_send == pytest.approx(0.25)
