"""Span extraction: JSON whose marked string values are verbatim spans of a source text.

A string property marked ``"x-span": true`` in a JSON schema may only take a
value that appears verbatim in the source (the request's user messages, the
prompt of a completion, or an explicit ``span_source``). This is enforced
while decoding, not checked afterwards: the schema becomes an xgrammar EBNF
grammar in which each marked leaf is a *span rule*, and vLLM's structured
output backend masks every token that would leave it.

Why a suffix automaton: the language "every substring of s" is regular, and
its minimal deterministic automaton (the suffix automaton) has at most 2n
states and 3n transitions for a source of n characters. Written as a
right-linear grammar, one rule per state, it is linear in the source and,
unlike "one rule per start position", unambiguous: after any prefix the
parser holds exactly one state, so the per-token mask costs the same for a
source of 500 or 4,000 characters (``loadtest/spans.py`` measures both).

Each source character appears in its JSON-escaped form (``"`` as ``\\"``, a
newline as ``\\n``, control characters as ``\\uXXXX``, non-ASCII as itself),
so the *decoded* JSON string is the substring. The rest of the schema is
turned into EBNF by xgrammar's own JSON-schema converter: each marked leaf is
first swapped for a ``const`` marker, and the marker's literal in xgrammar's
output is then replaced by the span rule.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from worker.sampling import RequestError

# Sources are joined with this character; spans never contain it, so a span
# never runs across two user messages.
SEPARATOR = "\x00"

# What a marked leaf may still say besides its type (and a description).
_SPAN_KEYWORDS = frozenset(
    {"type", "x-span", "description", "title", "minLength", "x-key-prompt", "examples"}
)


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
    markers: dict[str, bool] = field(default_factory=dict)  # marker -> empty allowed
    key_prompts: dict[str, str] = field(default_factory=dict)
    token: str = field(default_factory=lambda: secrets.token_hex(6))


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
    if not walk.markers:
        return plan
    if source is None:
        raise RequestError(
            400,
            "x-span needs a source text: user messages, a prompt, or span_source.",
            "span_source",
        )
    plan.grammar = _grammar(rewritten, walk, source, param)
    return plan


def _grammar(schema: dict[str, Any], walk: _Walk, source: str, param: str) -> str:
    import xgrammar as xgr

    try:
        base = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    except (RuntimeError, ValueError) as exc:
        raise RequestError(400, f"{param}: the schema cannot be compiled: {exc}", param) from exc
    prefix = f"span_{walk.token}"
    rules, any_span, nonempty_span = span_rules(source, prefix)
    if not source.replace(SEPARATOR, "") and not all(walk.markers.values()):
        raise RequestError(
            400, "x-span: the span source is empty, so no non-empty span exists.", "span_source"
        )
    for marker, empty_ok in walk.markers.items():
        literal = ebnf_literal(json.dumps(marker))
        if literal not in base:
            raise RequestError(400, f"{param}: unsupported use of x-span in this schema", param)
        base = base.replace(literal, any_span if empty_ok else nonempty_span)
    return base + "\n" + "\n".join(rules) + "\n"


def _rewrite(node: Any, walk: _Walk, path: str) -> Any:
    """A copy of ``node`` with span leaves as markers and prompted keys renamed."""
    if isinstance(node, list):
        return [_rewrite(item, walk, path) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("x-span"):
        return _span_marker(node, walk, path)
    out: dict[str, Any] = {}
    prompt_all = node.get("x-key-prompt") is True
    properties = node.get("properties")
    renames: dict[str, str] = {}
    if isinstance(properties, dict):
        renamed_props: dict[str, Any] = {}
        for name, sub in properties.items():
            sub_path = f"{path}.{name}" if path else name
            key = _prompted_key(name, sub, prompt_all, sub_path)
            if key != name:
                renames[name] = key
                walk.key_prompts[json.dumps(key, ensure_ascii=False)] = json.dumps(
                    name, ensure_ascii=False
                )
            renamed_props[key] = _rewrite(_without_key_prompt(sub), walk, sub_path)
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


def _without_key_prompt(sub: Any) -> Any:
    """A property's schema minus its own key-prompt mark (it applied to its key)."""
    if isinstance(sub, dict) and isinstance(sub.get("x-key-prompt"), str | bool):
        if "properties" not in sub:
            return {k: v for k, v in sub.items() if k != "x-key-prompt"}
    return sub


def _prompted_key(name: str, sub: Any, prompt_all: bool, path: str) -> str:
    """``name``, or ``name (instruction)`` when the schema asks for a key prompt."""
    if not isinstance(sub, dict):
        return name
    mark = sub.get("x-key-prompt")
    if isinstance(mark, str):
        text = mark
    elif mark is True or (prompt_all and mark is not False):
        text = sub.get("description") or ""
        if not isinstance(text, str):
            return name
    else:
        return name
    text = " ".join(text.split())
    if not text:
        if mark is True and "properties" not in sub:
            raise RequestError(
                400, f"x-key-prompt on property '{path}': it has no description to use", path
            )
        return name
    if any(char in text for char in '"\\') or any(ord(char) < 0x20 for char in text):
        raise RequestError(
            400,
            f"x-key-prompt on property '{path}': the prompt may not contain quotes, "
            "backslashes or control characters",
            path,
        )
    return f"{name} ({text})"


def _span_marker(node: dict[str, Any], walk: _Walk, path: str) -> dict[str, Any]:
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
    marker = f"XSPAN{walk.token}N{len(walk.markers)}"
    walk.markers[marker] = min_length == 0
    return {"const": marker}


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
    import time

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
        _refuse_logprobs(kind, params)
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


def _refuse_logprobs(kind: str, params: dict[str, Any]) -> None:
    """Key prompting rewrites text, so token logprobs would no longer match it."""
    wants = params.get("logprobs") if kind == "chat" else params.get("logprobs") is not None
    if wants or params.get("top_logprobs"):
        raise RequestError(
            400, "logprobs cannot be combined with x-key-prompt (keys are rewritten)", "logprobs"
        )
