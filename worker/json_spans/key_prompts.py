"""``x-key-prompt``: a key carries its instruction while the model writes, and loses it after.

With key prompting the schema's key ``birth_date`` becomes
``birth_date (YYYY-MM-DD)`` (:func:`prompted_key`), so the model writes the
instruction right before the tokens it governs; the client must see
``"birth_date": ...``. The text arrives in deltas, and a prompted key can be
split across them, so :class:`KeyRewriter` holds back any tail that could
still grow into a prompted key until it either completes (and is replaced)
or cannot (and is released unchanged).

A prompted key is matched with its quotes (``"name (prompt)"``), and only
where a JSON string opens, so a value that happens to contain one is left
alone.
"""

from __future__ import annotations

from typing import Any

from worker.errors import RequestError


def prompted_key(name: str, sub: Any, prompt_all: bool, path: str) -> str:
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


def without_key_prompt(sub: Any) -> Any:
    """A property's schema minus its own key-prompt mark (it applied to its key)."""
    if isinstance(sub, dict) and isinstance(sub.get("x-key-prompt"), str | bool):
        if "properties" not in sub:
            return {k: v for k, v in sub.items() if k != "x-key-prompt"}
    return sub


def refuse_logprobs(kind: str, params: dict[str, Any]) -> None:
    """Key prompting rewrites text, so token logprobs would no longer match it."""
    wants = params.get("logprobs") if kind == "chat" else params.get("logprobs") is not None
    if wants or params.get("top_logprobs"):
        raise RequestError(
            400, "logprobs cannot be combined with x-key-prompt (keys are rewritten)", "logprobs"
        )


class KeyRewriter:
    """Rewrites one choice's stream; ``generated`` lists the prompted keys it saw.

    It follows JSON's string lexing (inside a string or not, after a
    backslash or not) over the text it passes on, so only a quote that opens
    a string can start a prompted key: a value that quotes a prompted key is
    left as it is.
    """

    def __init__(self, replacements: dict[str, str]) -> None:
        # Prompted key -> plain key, both JSON-quoted.
        self.replacements = replacements
        self.held = ""
        self.generated: list[str] = []
        self.in_string = False
        self.escaped = False

    def feed(self, text: str, final: bool = False) -> str:
        """The part of ``held + text`` that is safe to send now, keys rewritten."""
        buffer = self.held + text
        self.held = ""
        out = []
        position = 0
        while position < len(buffer):
            char = buffer[position]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                rest = buffer[position:]
                prompted = next((key for key in self.replacements if rest.startswith(key)), None)
                if prompted is not None:
                    self.generated.append(prompted)
                    out.append(self.replacements[prompted])
                    position += len(prompted)
                    continue
                if not final and any(key.startswith(rest) for key in self.replacements):
                    self.held = rest
                    break
                self.in_string = True
            out.append(char)
            position += 1
        return "".join(out)
