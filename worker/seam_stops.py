"""Stop strings across the seam of a continued answer.

vLLM checks a request's ``stop`` strings in the text it generates, and holds
back the end of that text (as long as the longest stop string, less one)
until it knows no stop string begins there. A continued answer
(``worker.continuation``) has two parts: the text generated on the first
worker, whose held-back end the client never got, and the new text. vLLM
sees only the second; :class:`SeamStops` sends the first's held-back end
ahead of the new text and checks the stop strings where the two meet: a
stop string begun before the seam and ended after it ends the answer
there, as it would have on one worker. Once the text is past the seam by
the longest stop string, vLLM's own check is the only one needed.
"""

from __future__ import annotations


class SeamStops:
    """Feeds the new text through; says which stop string ended it, if one did."""

    def __init__(self, sent_tail: str, held: str, stops: list[str], include: bool) -> None:
        # The end of the text already sent (for a stop string begun in it;
        # never sent again), then the text held back, then the new text.
        self.text = sent_tail + held
        self.start = len(sent_tail)
        self.out = len(sent_tail)
        self.stops = [s for s in stops if s]
        self.include = include
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        # Past this, no stop string can begin before the seam.
        self.seam = len(self.text)
        self.through = not self.stops

    def feed(self, text: str, final: bool) -> tuple[str, str | None]:
        """What goes out of ``text`` (plus what was held), and the stop string
        that ends the answer here (None: it goes on)."""
        if self.through:
            return text, None
        self.text += text
        hit = self._first_stop()
        if hit is not None:
            at, stop = hit
            end = at + len(stop) if self.include else at
            out = self.text[self.out : max(self.out, end)]
            self.through = True
            return out, stop
        if final or len(self.text) >= self.seam + self.keep:
            # Whole, or past the seam by every stop string's length: nothing
            # held back here any longer (vLLM holds back its own).
            out = self.text[self.out :]
            self.through = True
            self.text = ""
            return out, None
        upto = max(self.out, len(self.text) - self.keep)
        out = self.text[self.out : upto]
        self.out = upto
        return out, None

    def _first_stop(self) -> tuple[int, str] | None:
        """The earliest stop string that ends past the text already sent and
        begins before the seam (one wholly after it is vLLM's to find)."""
        best: tuple[int, str] | None = None
        for stop in self.stops:
            # Begun no earlier than would reach past the sent text.
            at = self.text.find(stop, max(0, self.start - len(stop) + 1))
            if at == -1 or at >= self.seam:
                continue
            if best is None or at < best[0]:
                best = (at, stop)
        return best
