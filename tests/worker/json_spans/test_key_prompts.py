"""worker.json_spans.key_prompts: keys renamed in the schema, and plain again in the text
the client receives, however the stream is split."""

from __future__ import annotations

from typing import Any

import pytest

from worker.errors import RequestError
from worker.json_spans.key_prompts import KeyRewriter
from worker.json_spans.request import apply
from worker.json_spans.schema import plan_schema

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


def test_key_prompts_rename_keys_and_required() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "x-key-prompt": True,
        "properties": {
            "birth_date": {"type": "string", "description": "YYYY-MM-DD"},
            "name": {"type": "string"},
            "city": {"type": "string", "x-key-prompt": "the city of birth", "x-span": True},
        },
        "required": ["birth_date", "name", "city"],
    }
    plan = plan_schema(schema, "Born in Paris", "response_format")
    assert plan.key_prompts == {
        '"birth_date (YYYY-MM-DD)"': '"birth_date"',
        '"city (the city of birth)"': '"city"',
    }
    assert plan.grammar is not None and '\\"birth_date (YYYY-MM-DD)\\"' in plan.grammar
    key_only = plan_schema(
        {**schema, "properties": schema["properties"] | {"city": {"type": "string"}}}, None, "x"
    )
    assert key_only.grammar is None
    assert key_only.schema["required"] == ["birth_date (YYYY-MM-DD)", "name", "city"]


def test_key_prompts_refuse_logprobs() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "x-key-prompt": "why"}}}
    with pytest.raises(RequestError) as caught:
        apply("completion", {"prompt": "x", "logprobs": 1, "structured_outputs": {"json": schema}})
    assert caught.value.param == "logprobs"
