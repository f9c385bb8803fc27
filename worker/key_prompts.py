"""Prompted keys back to plain keys, in the text the client receives.

With key prompting the model writes ``"birth_date (YYYY-MM-DD)": ...``, so
the instruction sits right before the tokens it governs; the client must see
``"birth_date": ...``. The text arrives in deltas, and a prompted key can be
split across them, so :class:`KeyRewriter` holds back any tail that could
still grow into a prompted key until it either completes (and is replaced)
or cannot (and is released unchanged).

A prompted key is matched with its quotes (``"name (prompt)"``); the prompt
text is long and specific, so a value that repeats it verbatim, quotes
included, is the only false match, and the grammar makes it unlikely.
"""

from __future__ import annotations


class KeyRewriter:
    """Rewrites one choice's stream; ``generated`` lists the prompted keys it saw."""

    def __init__(self, replacements: dict[str, str]) -> None:
        # Prompted key -> plain key, both JSON-quoted.
        self.replacements = replacements
        self.held = ""
        self.generated: list[str] = []

    def feed(self, text: str, final: bool = False) -> str:
        """The part of ``held + text`` that is safe to send now, keys rewritten."""
        buffer = self.held + text
        self.held = ""
        out = []
        position = 0
        while True:
            quote = buffer.find('"', position)
            if quote < 0:
                out.append(buffer[position:])
                break
            out.append(buffer[position:quote])
            rest = buffer[quote:]
            prompted = next((key for key in self.replacements if rest.startswith(key)), None)
            if prompted is not None:
                self.generated.append(prompted)
                out.append(self.replacements[prompted])
                position = quote + len(prompted)
                continue
            if not final and any(key.startswith(rest) for key in self.replacements):
                self.held = rest
                break
            out.append('"')
            position = quote + 1
        return "".join(out)
