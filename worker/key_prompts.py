"""Prompted keys back to plain keys, in the text the client receives.

With key prompting the model writes ``"birth_date (YYYY-MM-DD)": ...``, so
the instruction sits right before the tokens it governs; the client must see
``"birth_date": ...``. The text arrives in deltas, and a prompted key can be
split across them, so :class:`KeyRewriter` holds back any tail that could
still grow into a prompted key until it either completes (and is replaced)
or cannot (and is released unchanged).

A prompted key is matched with its quotes (``"name (prompt)"``), and only
where a JSON string opens, so a value that happens to contain one is left
alone.
"""

from __future__ import annotations


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
