"""Every substring of a source text as a grammar: its suffix automaton, written as EBNF rules.

Why a suffix automaton: the language "every substring of s" is regular, and
its minimal deterministic automaton (the suffix automaton) has at most 2n
states and 3n transitions for a source of n characters. Written as a
right-linear grammar, one rule per state, it is linear in the source and,
unlike "one rule per start position", unambiguous: after any prefix the
parser holds exactly one state, so the per-token mask costs the same for a
source of 500 or 4,000 characters (``loadtest/spans.py`` measures both).

Each source character appears in its JSON-escaped form (``"`` as ``\\"``, a
newline as ``\\n``, control characters as ``\\uXXXX``, non-ASCII as itself),
so the *decoded* JSON string is the substring.
"""

from __future__ import annotations

import json

# Sources are joined with this character; spans never contain it, so a span
# never runs across two user messages.
SEPARATOR = "\x00"


class SuffixAutomaton:
    """The minimal automaton of every substring of ``text`` (Blumer et al. 1985).

    ``transitions[q]`` maps a character to the next state; state 0 is the
    start. Every state accepts: a path from 0 spells a substring.
    """

    def __init__(self, text: str) -> None:
        self.transitions: list[dict[str, int]] = [{}]
        link = [-1]
        length = [0]
        last = 0
        for char in text:
            current = len(self.transitions)
            self.transitions.append({})
            length.append(length[last] + 1)
            link.append(0)
            state = last
            while state != -1 and char not in self.transitions[state]:
                self.transitions[state][char] = current
                state = link[state]
            if state != -1:
                target = self.transitions[state][char]
                if length[state] + 1 == length[target]:
                    link[current] = target
                else:
                    clone = len(self.transitions)
                    self.transitions.append(dict(self.transitions[target]))
                    length.append(length[state] + 1)
                    link.append(link[target])
                    while state != -1 and self.transitions[state].get(char) == target:
                        self.transitions[state][char] = clone
                        state = link[state]
                    link[target] = clone
                    link[current] = clone
            last = current

    def accepts(self, text: str) -> bool:
        state = 0
        for char in text:
            nxt = self.transitions[state].get(char)
            if nxt is None:
                return False
            state = nxt
        return True


def json_escaped(char: str) -> str:
    """``char`` as it appears inside a JSON string (non-ASCII kept as itself)."""
    return json.dumps(char, ensure_ascii=False)[1:-1]


def ebnf_literal(text: str) -> str:
    """``text`` as an xgrammar EBNF string literal."""
    out = []
    for char in text:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif ord(char) < 0x20 or char == "\x7f":
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def span_rules(source: str, prefix: str) -> tuple[list[str], str, str]:
    """EBNF rules for the substrings of ``source``, JSON-escaped and quoted.

    Returns (rules, the rule for any span, the rule for a non-empty span);
    both span rules include the surrounding quotes.
    """
    automaton = SuffixAutomaton(source)
    rules = []
    literals: dict[str, str] = {}
    for state, moves in enumerate(automaton.transitions):
        alternatives = []
        for char, target in sorted(moves.items()):
            if char == SEPARATOR:
                continue
            literal = literals.get(char)
            if literal is None:
                literal = literals[char] = ebnf_literal(json_escaped(char))
            alternatives.append(f"({literal} {prefix}_{target})")
        if state == 0:
            body = " | ".join(alternatives) or '""'
            rules.append(f"{prefix}_0 ::= {body}")
        else:
            body = " | ".join(['""', *alternatives])
            rules.append(f"{prefix}_{state} ::= {body}")
    rules.append(f'{prefix} ::= "\\"" ({prefix}_0 | "") "\\""')
    rules.append(f'{prefix}_nonempty ::= "\\"" {prefix}_0 "\\""')
    return rules, prefix, f"{prefix}_nonempty"
