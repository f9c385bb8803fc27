"""``x-span``: a schema's marked string leaves become span rules in an xgrammar grammar.

A string property marked ``"x-span": true`` may only take a value that
appears verbatim in the source (the request's user messages, the prompt of a
completion, or an explicit ``span_source``). This is enforced while
decoding, not checked afterwards: the rest of the schema is turned into EBNF
by xgrammar's own JSON-schema converter, each marked leaf having first been
swapped for a ``const`` marker; the marker's literal in xgrammar's output is
then replaced by the span rule (``worker.json_spans.automaton``), and vLLM's
structured output backend masks every token that would leave it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

from worker.errors import RequestError
from worker.json_spans.automaton import SEPARATOR, ebnf_literal, span_rules

# What a marked leaf may still say besides its type (and a description).
_SPAN_KEYWORDS = frozenset(
    {"type", "x-span", "description", "title", "minLength", "x-key-prompt", "examples"}
)


class SpanLeaves:
    """The ``x-span`` leaves of one schema: markers while it is rewritten, span rules after."""

    def __init__(self) -> None:
        # Marker -> whether the span may be empty.
        self.markers: dict[str, bool] = {}
        # Names no schema or source contains by chance, for markers and rules.
        self.token = secrets.token_hex(6)

    def marker(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        """The ``const`` that stands for the marked leaf ``node`` until :meth:`grammar`."""
        where = path or "(root)"
        kind = node.get("type", "string")
        if kind != "string":
            raise RequestError(
                400,
                f"x-span on property '{where}': only a string can be a span, not {kind!r}",
                where,
            )
        extra = sorted(set(node) - _SPAN_KEYWORDS)
        if extra:
            raise RequestError(
                400,
                f"x-span on property '{where}': cannot combine with {', '.join(extra)}",
                where,
            )
        min_length = node.get("minLength", 0)
        if not isinstance(min_length, int) or min_length > 1:
            raise RequestError(
                400, f"x-span on property '{where}': minLength may only be 0 or 1", where
            )
        marker = f"XSPAN{self.token}N{len(self.markers)}"
        self.markers[marker] = min_length == 0
        return {"const": marker}

    def grammar(self, schema: dict[str, Any], source: str | None, param: str) -> str:
        """The EBNF grammar of ``schema`` (its leaves already markers), spans from ``source``."""
        if source is None:
            raise RequestError(
                400,
                "x-span needs a source text: user messages, a prompt, or span_source.",
                "span_source",
            )
        import xgrammar as xgr

        try:
            base = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
        except (RuntimeError, ValueError) as exc:
            raise RequestError(
                400, f"{param}: the schema cannot be compiled: {exc}", param
            ) from exc
        prefix = f"span_{self.token}"
        rules, any_span, nonempty_span = span_rules(source, prefix)
        if not source.replace(SEPARATOR, "") and not all(self.markers.values()):
            raise RequestError(
                400,
                "x-span: the span source is empty, so no non-empty span exists.",
                "span_source",
            )
        for marker, empty_ok in self.markers.items():
            literal = ebnf_literal(json.dumps(marker))
            if literal not in base:
                raise RequestError(400, f"{param}: unsupported use of x-span in this schema", param)
            base = base.replace(literal, any_span if empty_ok else nonempty_span)
        return base + "\n" + "\n".join(rules) + "\n"


def span_source(kind: str, params: dict[str, Any]) -> str | None:
    """The text spans are taken from: ``span_source``, else user messages / prompt."""
    explicit = params.get("span_source")
    if explicit is not None:
        if not isinstance(explicit, str):
            raise RequestError(400, "span_source must be a string", "span_source")
        return explicit
    if kind == "chat":
        texts = list(_user_texts(params.get("messages") or []))
        return SEPARATOR.join(texts) if texts else None
    prompt = params.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return SEPARATOR.join(prompt)
    return None


def _user_texts(messages: list[Any]) -> Iterator[str]:
    for message in messages:
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    yield str(part.get("text", ""))
