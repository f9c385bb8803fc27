"""A prompt's token ids as the engine will see them, in the gateway, with no model files.

A worker sends what it needs (``protocol.Tokenizer``: the tokenizer's JSON,
the chat template, its special tokens) when a gateway asks. A chat is
rendered with that template as Hugging Face's ``apply_chat_template`` does
(a sandboxed Jinja environment, ``trim_blocks`` and ``lstrip_blocks``,
``tojson``, ``raise_exception``), then tokenized without adding special
tokens; a completion's prompt is tokenized with them. Routing by the
engines' caches is what it is for: a prompt it renders otherwise than the
engine (a template feature it lacks) only finds fewer cached blocks.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared import protocol


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class PromptTokenizer:
    """One model's prompts to token ids, from what its workers sent."""

    def __init__(self, described: protocol.Tokenizer) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(described.tokenizer_json)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(described.chat_template or "")
        self._special = dict(described.special_tokens)

    def completion(self, prompt: str) -> list[int]:
        return list(self._tokenizer.encode(prompt, add_special_tokens=True).ids)

    def chat(self, messages: list[Any], tools: list[Any] | None = None) -> list[int]:
        """The token ids of ``messages`` with the generation prompt after them."""
        text = self._template.render(
            messages=[_flat(m) for m in messages],
            tools=tools,
            add_generation_prompt=True,
            **self._special,
        )
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


def _flat(message: Any) -> Any:
    """A message whose content is a list of text parts, as a string (vLLM joins them
    with newlines for a template that takes strings)."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and "text" in p]
        return {**message, "content": "\n".join(texts)}
    return message
