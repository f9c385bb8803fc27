"""One run of a background response, set against the events already sent.

A run's events are numbered from 0 as they come. The first time, every event
is new. When the response runs again (its replica died and another took it
over, or its worker failed mid-answer), the run starts from the beginning:
its events up to the last one sent are checked against those and dropped, and
the rest go on after them. The check is on what a client saw (the
stream's kind says what: ``gateway.background.kinds``), each event's type
and text. A run that says something else where the stored events said
something (a sampled answer, unseeded, or a tie broken the other way) cannot
continue them: :class:`Diverged`. The gateway gives each background request
a seed when it has none, so a run again draws the same tokens. Output item
ids are made afresh by each run: the new run's are renamed to the ones
already sent. Every event keeps the first run's fixed fields (a Responses
event's response: its id, ``created_at``, ``background``, ``store``; a
chunk's ``created``).
"""

from __future__ import annotations

from typing import Any

from gateway.background.kinds import Kind


class Diverged(Exception):
    """The run said something else than the events already sent."""


class Splice:
    def __init__(self, kind: Kind, sent: list[dict[str, Any]], fixed: dict[str, Any]) -> None:
        self.kind = kind
        self.sent = sent
        # The fields every event of the stream keeps.
        self.fixed = fixed
        self.seq = 0
        # This run's item ids -> those the client already saw.
        self.renamed: dict[str, str] = {}

    def take(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The event to send (its number set), or None if it was sent already."""
        seq = self.seq
        self.seq += 1
        self.kind.fix(event, self.fixed)
        if seq < len(self.sent):
            before = self.sent[seq]
            was, is_now = self.kind.said(before), self.kind.said(event)
            if was != is_now:
                raise Diverged(f"event {seq}: {was!r} was sent, the run again gave {is_now!r}")
            for then, now in zip(_ids(before), _ids(event), strict=False):
                if then != now:
                    self.renamed[now] = then
            return None
        if self.renamed:
            _rename(event, self.renamed)
        self.kind.number(event, seq)
        return event


def _items(event: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items an event carries (its item, its response's output)."""
    found = [event["item"]] if isinstance(event.get("item"), dict) else []
    response = event.get("response")
    if isinstance(response, dict) and isinstance(response.get("output"), list):
        found += [item for item in response["output"] if isinstance(item, dict)]
    return found


def _ids(event: dict[str, Any]) -> list[str]:
    ids = [event["item_id"]] if isinstance(event.get("item_id"), str) else []
    return ids + [item["id"] for item in _items(event) if isinstance(item.get("id"), str)]


def _rename(event: dict[str, Any], renamed: dict[str, str]) -> None:
    if event.get("item_id") in renamed:
        event["item_id"] = renamed[event["item_id"]]
    for item in _items(event):
        if item.get("id") in renamed:
            item["id"] = renamed[item["id"]]
