"""worker.json_spans.automaton: the suffix automaton accepts exactly the source's substrings."""

from __future__ import annotations

import random

from worker.json_spans.automaton import SuffixAutomaton


def test_suffix_automaton_accepts_exactly_the_substrings() -> None:
    rng = random.Random(7)
    text = "".join(rng.choice("ab c") for _ in range(200))
    automaton = SuffixAutomaton(text)
    assert len(automaton.transitions) <= 2 * len(text)
    for _ in range(2000):
        start = rng.randrange(len(text))
        assert automaton.accepts(text[start : start + rng.randrange(1, 30)])
        probe = "".join(rng.choice("ab c") for _ in range(rng.randrange(1, 12)))
        assert automaton.accepts(probe) == (probe in text)
