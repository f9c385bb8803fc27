"""A prompt's token ids as the engine will see them, in the gateway, with no model files.

A worker sends what it needs (``protocol.Tokenizer``: the tokenizer's JSON,
the chat template, its special tokens) when a gateway asks. A chat is
rendered with that template as Hugging Face's ``apply_chat_template`` does
(a sandboxed Jinja environment, ``trim_blocks`` and ``lstrip_blocks``,
``tojson``, ``raise_exception``), then tokenized without adding special
tokens; a completion's prompt is tokenized with them. Routing by the
engines' caches is what it is for: a prompt it renders otherwise than the
engine (a template feature it lacks) only finds fewer cached blocks.

Tokenizing is most of the cost (about 1 ms per 1,000 tokens on one core), so
a rendered chat is cut after each special token the template writes (the
tokenizer splits its input there first, so each piece tokenizes alone as it
does in the whole) and each piece's ids are kept in a bounded LRU map: a
document, instructions or a history seen before costs a lookup; a caller
may also ask for a prompt's start only, as far as kept pieces and a number of
fresh characters reach. A tokenizer for which pieces and whole differ
(checked once, on a sample chat) tokenizes the whole every time.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import OrderedDict
from datetime import datetime
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared import protocol

# Characters of pieces kept tokenized per model: their ids take about a
# byte per character (4-byte ids, about 4 characters a token), 16 MiB.
KEPT_CHARS = 16 << 20


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
        self._kept: OrderedDict[str, array[int]] = OrderedDict()
        self._kept_chars = 0
        self._cut = _cut_after(described.tokenizer_json, described.chat_template or "")
        if self._cut is not None and not self._pieces_agree():
            self._cut = None

    def completion(self, prompt: str) -> list[int]:
        return list(self._tokenizer.encode(prompt, add_special_tokens=True).ids)

    def completion_ids(self, prompt: str, fresh: int | None = None) -> tuple[array[int], bool]:
        """As ``chat_ids``, for a completion's prompt (not kept: it is one piece)."""
        cut = fresh is not None and len(prompt) > fresh
        text = prompt[:fresh] if cut else prompt
        return array("I", self._tokenizer.encode(text, add_special_tokens=True).ids), cut

    def chat(self, messages: list[Any], tools: list[Any] | None = None) -> list[int]:
        """The token ids of ``messages`` with the generation prompt after them."""
        return list(self.chat_ids(messages, tools)[0])

    def chat_ids(
        self, messages: list[Any], tools: list[Any] | None = None, fresh: int | None = None
    ) -> tuple[array[int], bool]:
        """As ``chat``, as an array (no list of int objects); with ``fresh``, of the
        rendered prompt's start only, as far as pieces kept tokenized and at most
        ``fresh`` more characters reach; and whether it stops short of the whole.
        Only the tokens of the word such a cut falls in may differ from the whole's."""
        text = self._template.render(
            messages=[_flat(m) for m in messages],
            tools=tools,
            add_generation_prompt=True,
            **self._special,
        )
        if self._cut is None:
            cut = fresh is not None and len(text) > fresh
            return self._encode(text[:fresh] if cut else text), cut
        ids: array[int] = array("I")
        start = 0
        ends = [m.end() for m in self._cut.finditer(text)]
        if not ends or ends[-1] < len(text):
            ends.append(len(text))
        for end in ends:
            piece = text[start:end]
            start = end
            kept = self._kept.get(piece)
            if kept is not None:
                self._kept.move_to_end(piece)
                ids.extend(kept)
                continue
            if fresh is not None:
                if len(piece) > fresh:
                    # Not kept: a piece the cut shortened is not the piece.
                    ids.extend(self._encode(piece[:fresh]))
                    return ids, True
                fresh -= len(piece)
            ids.extend(self._keep(piece))
        return ids, False

    def _encode(self, text: str) -> array[int]:
        return array("I", self._tokenizer.encode(text, add_special_tokens=False).ids)

    def _keep(self, text: str) -> array[int]:
        """A piece's ids, kept (the least recently used go past ``KEPT_CHARS``)."""
        kept = self._kept[text] = self._encode(text)
        self._kept_chars += len(text)
        while self._kept_chars > KEPT_CHARS and len(self._kept) > 1:
            old, _ = self._kept.popitem(last=False)
            self._kept_chars -= len(old)
        return kept

    def _pieces_agree(self) -> bool:
        """Whether a sample chat tokenizes the same cut in pieces as whole."""
        sample = [
            {"role": "system", "content": " Be brief.\n\n"},
            {"role": "user", "content": "Hello  there, héllo 🚀 ?"},
            {"role": "assistant", "content": "\tHi!"},
            {"role": "user", "content": " 12345 and\nmore."},
        ]
        try:
            text = self._template.render(
                messages=sample, tools=None, add_generation_prompt=True, **self._special
            )
        except TemplateError:
            return False
        whole = self._tokenizer.encode(text, add_special_tokens=False).ids
        pieced = list(self.chat_ids(sample)[0])
        self._kept.clear()
        self._kept_chars = 0
        return pieced == whole


def _cut_after(tokenizer_json: str, template: str) -> re.Pattern[str] | None:
    """The special tokens the template writes, as a pattern to cut text after (None:
    none). Only tokens the tokenizer splits out whole, without taking the spaces
    beside them (``lstrip``/``rstrip``), cut exactly."""
    added = json.loads(tokenizer_json).get("added_tokens", [])
    markers = sorted(
        (
            t["content"]
            for t in added
            if t.get("content")
            and t["content"] in template
            and not t.get("lstrip")
            and not t.get("rstrip")
        ),
        key=len,
        reverse=True,
    )
    return re.compile("|".join(map(re.escape, markers))) if markers else None


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
