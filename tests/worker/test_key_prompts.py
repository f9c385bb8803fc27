"""worker.key_prompts: prompted keys become plain keys, however the stream is split."""

from __future__ import annotations

from worker.key_prompts import KeyRewriter

REPLACEMENTS = {'"birth_date (YYYY-MM-DD)"': '"birth_date"', '"name (first one)"': '"name"'}
GENERATED = '{"name (first one)": "Ann \\"A\\"", "birth_date (YYYY-MM-DD)": "1990-01-02", "x": ""}'
EXPECTED = '{"name": "Ann \\"A\\"", "birth_date": "1990-01-02", "x": ""}'


def test_whole_text() -> None:
    rewriter = KeyRewriter(REPLACEMENTS)
    assert rewriter.feed(GENERATED, final=True) == EXPECTED
    assert rewriter.generated == ['"name (first one)"', '"birth_date (YYYY-MM-DD)"']


def test_every_split_point_and_every_char_alone() -> None:
    for cut in range(len(GENERATED) + 1):
        rewriter = KeyRewriter(REPLACEMENTS)
        out = rewriter.feed(GENERATED[:cut]) + rewriter.feed(GENERATED[cut:], final=True)
        assert out == EXPECTED, cut
    rewriter = KeyRewriter(REPLACEMENTS)
    pieces = [rewriter.feed(char) for char in GENERATED]
    assert "".join(pieces) + rewriter.feed("", final=True) == EXPECTED
    # Nothing prompted ever reaches the client, even in part.
    assert not any("(first" in piece for piece in pieces)


def test_unfinished_key_is_released_at_the_end() -> None:
    rewriter = KeyRewriter(REPLACEMENTS)
    assert rewriter.feed('{"name (fir') == "{"
    assert rewriter.feed("", final=True) == '"name (fir'


def test_a_value_quoting_a_prompted_key_is_left_alone() -> None:
    text = '{"name (first one)": "x \\"name (first one)", "y": "\\\\"}'
    for cut in range(len(text) + 1):
        rewriter = KeyRewriter(REPLACEMENTS)
        out = rewriter.feed(text[:cut]) + rewriter.feed(text[cut:], final=True)
        assert out == '{"name": "x \\"name (first one)", "y": "\\\\"}', cut
