"""Stop strings across a continued answer's seam (``worker.seam_stops``)."""

from __future__ import annotations

from worker.seam_stops import SeamStops


def feed_all(seam: SeamStops, parts: list[str]) -> tuple[str, str | None]:
    out = ""
    for i, part in enumerate(parts):
        text, stop = seam.feed(part, final=i == len(parts) - 1)
        out += text
        if stop is not None:
            return out, stop
    return out, None


def test_the_held_back_text_goes_out_before_the_new_text() -> None:
    seam = SeamStops("", " capital of", ["zzz"], include=False)
    assert feed_all(seam, [" France", " is", " Paris."]) == (" capital of France is Paris.", None)


def test_a_stop_string_begun_before_the_seam_ends_the_answer_there() -> None:
    seam = SeamStops("", " capital of", ["of Fr"], include=False)
    assert feed_all(seam, [" F", "rance", " is"]) == (" capital ", "of Fr")


def test_the_stop_string_itself_goes_out_when_asked() -> None:
    seam = SeamStops("", " capital of", ["of Fr"], include=True)
    assert feed_all(seam, [" France"]) == (" capital of Fr", "of Fr")


def test_a_stop_string_begun_in_the_text_already_sent_is_found_and_not_sent_again() -> None:
    # Without hold-back (include), the first worker sent "\n"; the next adds "\n".
    seam = SeamStops("A\n", "", ["\n\n"], include=True)
    assert feed_all(seam, ["\nB"]) == ("\n", "\n\n")


def test_text_is_held_only_while_a_stop_string_could_still_cross_the_seam() -> None:
    seam = SeamStops("", "ab", ["xyz"], include=False)
    # Two characters kept back (a stop of three could begin in them)...
    assert seam.feed("c", final=False) == ("a", None)
    # ...until the text is past the seam by the longest stop: then all goes through.
    assert seam.feed("de", final=False) == ("bcde", None)
    assert seam.feed("xyz", final=False) == ("xyz", None)  # vLLM's to find now


def test_an_answer_that_ends_sends_everything_held() -> None:
    seam = SeamStops("", "of", ["of F"], include=False)
    assert seam.feed("", final=True) == ("of", None)
