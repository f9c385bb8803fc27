"""A request body's schema with ``x-span`` / ``x-key-prompt`` turned into what vLLM runs.

Where the schema is (``response_format`` or ``structured_outputs.json``),
where the span source is, and what replaces them: a grammar in
``structured_outputs.grammar``, or the schema with its keys renamed. vLLM
never sees our extensions, nor ``span_source``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from worker.errors import RequestError
from worker.json_spans.grammar import span_source
from worker.json_spans.key_prompts import refuse_logprobs
from worker.json_spans.schema import plan_schema, uses_extensions


@dataclass
class Applied:
    """A request body with its span/key-prompt schema turned into what vLLM runs."""

    params: dict[str, Any]
    # Prompted key -> plain key (JSON-quoted), when the schema prompts inside keys.
    key_prompts: dict[str, str] = field(default_factory=dict)
    # Grammar rules and build time, when a span grammar was built (for the log).
    grammar_rules: int = 0
    build_seconds: float = 0.0


# The request fields that can carry a schema with extensions, or their source.
_FIELDS = ("response_format", "structured_outputs", "span_source")


def apply(kind: str, params: dict[str, Any]) -> Applied:
    """Rewrite ``params`` when its schema uses ``x-span`` or ``x-key-prompt``.

    A schema in ``response_format`` (json_schema) or ``structured_outputs.json``
    with spans becomes ``structured_outputs.grammar``; one with key prompts
    only stays a schema, with the keys renamed. ``span_source`` is removed
    (vLLM does not know it). Anything else passes through untouched.
    """
    if not any(field in params for field in _FIELDS):
        return Applied(params)  # most requests: nothing to look at, nothing copied
    params = dict(params)
    has_source = "span_source" in params
    source = span_source(kind, params)
    params.pop("span_source", None)
    located = _find_schema(params)
    if located is None:
        if has_source:
            raise RequestError(
                400, "span_source needs a JSON schema with x-span properties", "span_source"
            )
        return Applied(params)
    param, schema = located
    if not uses_extensions(schema):
        return Applied(params)
    started = time.perf_counter()
    plan = plan_schema(schema, source, param)
    elapsed = time.perf_counter() - started
    if plan.key_prompts:
        refuse_logprobs(kind, params)
    if plan.grammar is not None:
        structured = dict(params.get("structured_outputs") or {})
        structured.pop("json", None)
        structured["grammar"] = plan.grammar
        params["structured_outputs"] = structured
        params.pop("response_format", None)
        return Applied(params, plan.key_prompts, plan.grammar.count("::="), elapsed)
    if param == "response_format":
        response_format = dict(params["response_format"])
        response_format["json_schema"] = {**response_format["json_schema"], "schema": plan.schema}
        params["response_format"] = response_format
    else:
        params["structured_outputs"] = {**params["structured_outputs"], "json": plan.schema}
    return Applied(params, plan.key_prompts)


def _find_schema(params: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(request field, JSON schema) of a request's structured output, if any."""
    response_format = params.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        spec = response_format.get("json_schema")
        if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
            return "response_format", spec["schema"]
    structured = params.get("structured_outputs")
    if isinstance(structured, dict) and structured.get("json") is not None:
        schema = structured["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise RequestError(
                    400, f"structured_outputs.json is not JSON: {exc}", "structured_outputs"
                ) from exc
        if isinstance(schema, dict):
            return "structured_outputs", schema
    return None
