"""What a response is cached under, and whether a request may use the cache.

The key is a hash of the request kind, the served model, and every body
field that can change the output, encoded canonically (JSON with sorted
keys), so two bodies that differ only in key order or in fields that cannot
change the output share an entry. The fields left out:

* ``model``: the requested name may be an alias; the served model it
  resolved to stands in the key instead (the response names the requested
  one, as always).
* ``stream``, ``stream_options``: a streamed and a whole response carry the
  same output; a hit is replayed in the shape the request asks for.
* ``user``: an end-user id for abuse tracking, not an input to the model.

Request ids are headers, never part of the body, so never of the key.

Only deterministic requests are served from the cache by default
(``--cache-scope deterministic``): temperature 0, or an explicit ``seed``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

NOT_IN_KEY = frozenset({"model", "stream", "stream_options", "user"})
Scope = Literal["deterministic", "greedy", "all"]
# Bumped when the key's recipe or the entry's format changes.
FORMAT = 1

_encode_sorted = msgspec.json.Encoder(order="sorted").encode


def key_for(kind: str, served_model: str, body: dict[str, Any]) -> str:
    fields = {name: value for name, value in body.items() if name not in NOT_IN_KEY}
    payload = _encode_sorted([FORMAT, kind, served_model, fields])
    return hashlib.sha256(payload).hexdigest()


def in_scope(body: dict[str, Any], scope: str) -> bool:
    """Whether ``body``'s output is repeatable enough for ``--cache-scope``."""
    if scope == "all":
        return True
    greedy = body.get("temperature") == 0
    if scope == "greedy":
        return greedy
    return greedy or body.get("seed") is not None


@dataclass(frozen=True, slots=True)
class Controls:
    """The request's ``Cache-Control``: whether the cache may answer, and keep the answer."""

    read: bool = True
    write: bool = True


def controls(cache_control: str | None) -> Controls:
    """``no-cache``: compute afresh (and store); ``no-store``: neither read nor store."""
    if not cache_control:
        return Controls()
    directives = {part.strip().lower() for part in cache_control.split(",")}
    if "no-store" in directives:
        return Controls(read=False, write=False)
    if "no-cache" in directives:
        return Controls(read=False, write=True)
    return Controls()
