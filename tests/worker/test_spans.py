"""worker.spans: the suffix automaton, the span grammar, schema rewriting (no engine)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from worker import spans
from worker.sampling import RequestError

SOURCE = 'Dr. Émile "Mile" Zola\nwrote C:\\tmp on 1902-09-29, paid €12.50.\tEnd\x01.'
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "x-span": True},
        "tags": {"type": "array", "items": {"type": "string", "x-span": True, "minLength": 1}},
        "year": {"type": "integer"},
    },
    "required": ["name", "tags", "year"],
}


def _accepts(grammar: str, text: str) -> bool:
    return bool(_is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar), text))


def test_suffix_automaton_accepts_exactly_the_substrings() -> None:
    rng = random.Random(7)
    text = "".join(rng.choice("ab c") for _ in range(200))
    automaton = spans.SuffixAutomaton(text)
    assert len(automaton.transitions) <= 2 * len(text)
    for _ in range(2000):
        start = rng.randrange(len(text))
        assert automaton.accepts(text[start : start + rng.randrange(1, 30)])
        probe = "".join(rng.choice("ab c") for _ in range(rng.randrange(1, 12)))
        assert automaton.accepts(probe) == (probe in text)


def test_grammar_accepts_escaped_substrings_only() -> None:
    grammar = spans.plan_schema(SCHEMA, SOURCE, "response_format").grammar
    assert grammar is not None
    for name in ['Émile "Mile" Zola\nwrote', "C:\\tmp", "€12.50.\tEnd\x01", ""]:
        text = json.dumps({"name": name, "tags": ["1902"], "year": 1902}, ensure_ascii=False)
        assert _accepts(grammar, text), text
    for name in ["Emile", "Zola wrote", "12.50 €"]:
        text = json.dumps({"name": name, "tags": ["1902"], "year": 1902}, ensure_ascii=False)
        assert not _accepts(grammar, text), text
    # minLength 1: no empty tag.
    assert not _accepts(grammar, json.dumps({"name": "Dr", "tags": [""], "year": 1}))


def test_spans_do_not_cross_user_messages() -> None:
    params = {"messages": [{"role": "user", "content": "abc"}, {"role": "user", "content": "def"}]}
    source = spans.span_source("chat", params)
    grammar = spans.plan_schema({"type": "string", "x-span": True}, source, "x").grammar
    assert grammar is not None
    assert _accepts(grammar, '"bc"') and _accepts(grammar, '"de"')
    assert not _accepts(grammar, '"cd"')


@pytest.mark.parametrize(
    ("schema", "param"),
    [
        ({"type": "object", "properties": {"age": {"type": "number", "x-span": True}}}, "age"),
        (
            {
                "type": "object",
                "properties": {
                    "p": {
                        "type": "object",
                        "properties": {"d": {"x-span": True, "type": "integer"}},
                    }
                },
            },
            "p.d",
        ),
        (
            {
                "type": "object",
                "properties": {"s": {"type": "string", "x-span": True, "pattern": "a"}},
            },
            "s",
        ),
    ],
)
def test_span_where_it_cannot_apply_is_400_naming_the_property(
    schema: dict[str, object], param: str
) -> None:
    with pytest.raises(RequestError) as caught:
        spans.plan_schema(schema, "text", "response_format")
    assert caught.value.status == 400 and caught.value.param == param
    assert f"'{param}'" in caught.value.message


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
    plan = spans.plan_schema(schema, "Born in Paris", "response_format")
    assert plan.key_prompts == {
        '"birth_date (YYYY-MM-DD)"': '"birth_date"',
        '"city (the city of birth)"': '"city"',
    }
    assert plan.grammar is not None and '\\"birth_date (YYYY-MM-DD)\\"' in plan.grammar
    key_only = spans.plan_schema(
        {**schema, "properties": schema["properties"] | {"city": {"type": "string"}}}, None, "x"
    )
    assert key_only.grammar is None
    assert key_only.schema["required"] == ["birth_date (YYYY-MM-DD)", "name", "city"]


def test_apply_turns_response_format_into_a_grammar() -> None:
    params: dict[str, Any] = {
        "messages": [{"role": "user", "content": SOURCE}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    }
    applied = spans.apply("chat", params)
    assert "response_format" not in applied.params
    assert "grammar" in applied.params["structured_outputs"]
    assert params["response_format"]["json_schema"]["schema"] is SCHEMA  # not mutated


def test_apply_leaves_plain_schemas_alone() -> None:
    params = {"prompt": "x", "structured_outputs": {"json": {"type": "object"}}}
    assert spans.apply("completion", params).params == params


def test_key_prompts_refuse_logprobs() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "x-key-prompt": "why"}}}
    with pytest.raises(RequestError) as caught:
        spans.apply(
            "completion", {"prompt": "x", "logprobs": 1, "structured_outputs": {"json": schema}}
        )
    assert caught.value.param == "logprobs"


def test_span_source_must_be_used() -> None:
    with pytest.raises(RequestError) as caught:
        spans.apply("completion", {"prompt": "x", "span_source": "y"})
    assert caught.value.param == "span_source"


def test_a_span_without_a_source_is_400_naming_span_source() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "x-span": True}}}
    with pytest.raises(RequestError) as caught:
        spans.apply("completion", {"prompt": [1, 2, 3], "structured_outputs": {"json": schema}})
    assert caught.value.param == "span_source"


def test_span_source_overrides_the_messages() -> None:
    params = {"messages": [{"role": "user", "content": "abc"}], "span_source": "xyz"}
    assert spans.span_source("chat", params) == "xyz"
    parts = [{"type": "text", "text": "one"}, {"type": "image_url", "image_url": {"url": "u"}}]
    assert spans.span_source("chat", {"messages": [{"role": "user", "content": parts}]}) == "one"


def test_spans_compose_with_refs_and_any_of() -> None:
    schema = {
        "type": "object",
        "$defs": {
            "who": {
                "type": "object",
                "properties": {"n": {"type": "string", "x-span": True}},
                "required": ["n"],
            }
        },
        "properties": {
            "a": {"$ref": "#/$defs/who"},
            "b": {"anyOf": [{"type": "string", "x-span": True}, {"type": "integer"}]},
        },
        "required": ["a", "b"],
    }
    grammar = spans.plan_schema(schema, "hello world", "x").grammar
    assert grammar is not None
    assert _accepts(grammar, '{"a": {"n": "lo w"}, "b": 3}')
    assert _accepts(grammar, '{"a": {"n": "o"}, "b": "world"}')
    assert not _accepts(grammar, '{"a": {"n": "low"}, "b": 3}')
    assert not _accepts(grammar, '{"a": {"n": "o"}, "b": "worlds"}')
