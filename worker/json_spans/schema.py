"""One walk over a JSON schema for both marks: ``x-span`` leaves and ``x-key-prompt`` keys.

The walk copies the schema, swapping each span leaf for a marker
(``worker.json_spans.grammar``) and renaming each prompted key
(``worker.json_spans.key_prompts``, ``required`` included); what it found decides
what vLLM runs: a grammar when a leaf is a span, else the renamed schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from worker.json_spans.grammar import SpanLeaves
from worker.json_spans.key_prompts import prompted_key, without_key_prompt


@dataclass
class SpanPlan:
    """What ``x-span`` / ``x-key-prompt`` turned a schema into."""

    # The schema to hand to vLLM when no span is marked (key prompts only).
    schema: dict[str, Any]
    # The EBNF grammar, when some leaf is a span; replaces the schema.
    grammar: str | None = None
    # Prompted key (JSON-quoted) -> plain key (JSON-quoted), for the rewriter.
    key_prompts: dict[str, str] = field(default_factory=dict)


@dataclass
class _Walk:
    spans: SpanLeaves = field(default_factory=SpanLeaves)
    key_prompts: dict[str, str] = field(default_factory=dict)


def uses_extensions(schema: Any) -> bool:
    """Whether ``schema`` marks anything with ``x-span`` or ``x-key-prompt``."""
    if isinstance(schema, dict):
        if schema.get("x-span") or schema.get("x-key-prompt"):
            return True
        return any(uses_extensions(value) for value in schema.values())
    if isinstance(schema, list):
        return any(uses_extensions(value) for value in schema)
    return False


def plan_schema(schema: dict[str, Any], source: str | None, param: str) -> SpanPlan:
    """Rewrite ``schema`` for its ``x-span`` leaves and ``x-key-prompt`` keys.

    ``source`` is the span source (None when the request has none); ``param``
    names the request field for errors. A mark that cannot apply is a 400
    naming the property.
    """
    walk = _Walk()
    rewritten = _rewrite(schema, walk, path="")
    plan = SpanPlan(schema=rewritten, key_prompts=walk.key_prompts)
    if walk.spans.markers:
        plan.grammar = walk.spans.grammar(rewritten, source, param)
    return plan


def _rewrite(node: Any, walk: _Walk, path: str) -> Any:
    """A copy of ``node`` with span leaves as markers and prompted keys renamed."""
    if isinstance(node, list):
        return [_rewrite(item, walk, path) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("x-span"):
        return walk.spans.marker(node, path)
    out: dict[str, Any] = {}
    prompt_all = node.get("x-key-prompt") is True
    properties = node.get("properties")
    renames: dict[str, str] = {}
    if isinstance(properties, dict):
        renamed_props: dict[str, Any] = {}
        for name, sub in properties.items():
            sub_path = f"{path}.{name}" if path else name
            key = prompted_key(name, sub, prompt_all, sub_path)
            if key != name:
                renames[name] = key
                walk.key_prompts[json.dumps(key, ensure_ascii=False)] = json.dumps(
                    name, ensure_ascii=False
                )
            renamed_props[key] = _rewrite(without_key_prompt(sub), walk, sub_path)
        out["properties"] = renamed_props
    for name, value in node.items():
        if name in ("properties", "x-key-prompt"):
            continue
        if name == "required" and isinstance(value, list):
            out[name] = [renames.get(item, item) for item in value]
        elif name in ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf"):
            out[name] = _rewrite(value, walk, f"{path}[]" if name == "items" else path)
        elif name in ("$defs", "definitions") and isinstance(value, dict):
            out[name] = {k: _rewrite(v, walk, f"{name}.{k}") for k, v in value.items()}
        else:
            out[name] = value
    return out
