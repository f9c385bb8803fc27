"""worker.json_spans.schema: the walk finds marks wherever a schema may put them."""

from __future__ import annotations

from tests.worker.json_spans.test_grammar import accepts
from worker.json_spans.schema import plan_schema


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
    grammar = plan_schema(schema, "hello world", "x").grammar
    assert grammar is not None
    assert accepts(grammar, '{"a": {"n": "lo w"}, "b": 3}')
    assert accepts(grammar, '{"a": {"n": "o"}, "b": "world"}')
    assert not accepts(grammar, '{"a": {"n": "low"}, "b": 3}')
    assert not accepts(grammar, '{"a": {"n": "o"}, "b": "worlds"}')
