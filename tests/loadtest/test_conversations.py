"""``loadtest.conversations``: the multi-turn bench's simulated users."""

from __future__ import annotations

from loadtest import conversations


def test_texts_are_the_same_for_a_user_and_turn_and_differ_otherwise() -> None:
    a = conversations.user_message("run", 1, 2, 30)
    assert a == conversations.user_message("run", 1, 2, 30)
    assert a != conversations.user_message("run", 2, 2, 30)
    assert a != conversations.user_message("other run", 1, 2, 30)
    # Each run's system prompt starts with its tag: no run reuses another's cache.
    assert conversations.system_prompt("x", 10).startswith("[x]")


def test_arrivals_are_all_at_once_without_a_rate_and_a_fixed_poisson_process_with_one() -> None:
    assert conversations.arrival_offsets(3, 0) == [0.0, 0.0, 0.0]
    offsets = conversations.arrival_offsets(400, 0.5)
    # The same times under every policy (and every run), in order, starting at once.
    assert offsets == conversations.arrival_offsets(400, 0.5)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    # Mean gap 1/rate = 2 s; over 399 gaps of this fixed draw, well within 20%.
    mean_gap = offsets[-1] / (len(offsets) - 1)
    assert 1.6 < mean_gap < 2.4
