"""worker.json_spans.grammar: x-span leaves become span rules; the source they are taken from."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from worker.errors import RequestError
from worker.json_spans.grammar import span_source
from worker.json_spans.request import apply
from worker.json_spans.schema import plan_schema

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


def accepts(grammar: str, text: str) -> bool:
    return bool(_is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar), text))


def test_grammar_accepts_escaped_substrings_only() -> None:
    grammar = plan_schema(SCHEMA, SOURCE, "response_format").grammar
    assert grammar is not None
    for name in ['Émile "Mile" Zola\nwrote', "C:\\tmp", "€12.50.\tEnd\x01", ""]:
        text = json.dumps({"name": name, "tags": ["1902"], "year": 1902}, ensure_ascii=False)
        assert accepts(grammar, text), text
    for name in ["Emile", "Zola wrote", "12.50 €"]:
        text = json.dumps({"name": name, "tags": ["1902"], "year": 1902}, ensure_ascii=False)
        assert not accepts(grammar, text), text
    # minLength 1: no empty tag.
    assert not accepts(grammar, json.dumps({"name": "Dr", "tags": [""], "year": 1}))


def test_spans_do_not_cross_user_messages() -> None:
    params = {"messages": [{"role": "user", "content": "abc"}, {"role": "user", "content": "def"}]}
    source = span_source("chat", params)
    grammar = plan_schema({"type": "string", "x-span": True}, source, "x").grammar
    assert grammar is not None
    assert accepts(grammar, '"bc"') and accepts(grammar, '"de"')
    assert not accepts(grammar, '"cd"')


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
        plan_schema(schema, "text", "response_format")
    assert caught.value.status == 400 and caught.value.param == param
    assert f"'{param}'" in caught.value.message


def test_a_span_without_a_source_is_400_naming_span_source() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "x-span": True}}}
    with pytest.raises(RequestError) as caught:
        apply("completion", {"prompt": [1, 2, 3], "structured_outputs": {"json": schema}})
    assert caught.value.param == "span_source"


def test_span_source_overrides_the_messages() -> None:
    params = {"messages": [{"role": "user", "content": "abc"}], "span_source": "xyz"}
    assert span_source("chat", params) == "xyz"
    parts = [{"type": "text", "text": "one"}, {"type": "image_url", "image_url": {"url": "u"}}]
    assert span_source("chat", {"messages": [{"role": "user", "content": parts}]}) == "one"
