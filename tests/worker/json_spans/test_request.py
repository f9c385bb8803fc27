"""worker.json_spans.request: a request body's schema in, what vLLM runs out."""

from __future__ import annotations

from typing import Any

import pytest

from tests.worker.json_spans.test_grammar import SCHEMA, SOURCE
from worker.errors import RequestError
from worker.json_spans.request import apply


def test_apply_turns_response_format_into_a_grammar() -> None:
    params: dict[str, Any] = {
        "messages": [{"role": "user", "content": SOURCE}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    }
    applied = apply("chat", params)
    assert "response_format" not in applied.params
    assert "grammar" in applied.params["structured_outputs"]
    assert params["response_format"]["json_schema"]["schema"] is SCHEMA  # not mutated


def test_apply_leaves_plain_schemas_alone() -> None:
    params = {"prompt": "x", "structured_outputs": {"json": {"type": "object"}}}
    assert apply("completion", params).params == params


def test_span_source_must_be_used() -> None:
    with pytest.raises(RequestError) as caught:
        apply("completion", {"prompt": "x", "span_source": "y"})
    assert caught.value.param == "span_source"
