"""JSON bodies: the one encoder for every JSON the gateway writes, and the
response that carries one.

:func:`encode` is msgspec's (several times faster than ``json.dumps``, and
it encodes msgspec structs as they are); whole responses, error bodies and
the payloads of server-sent events (``gateway.dialects.sse``, which frames them) all
go through it. :func:`json_response` is what a route returns for a JSON
answer it builds itself; :class:`JSONAnswer` is a whole completion's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.responses import Response

JSON = "application/json"

encode = msgspec.json.encode


def json_response(
    value: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """``value`` as a JSON response of ``status``, with ``headers``."""
    return Response(encode(value), status_code=status, headers=headers, media_type=JSON)


class JSONAnswer(Response):
    """A JSON body already encoded, with headers whose names are lower-case
    (``gateway.api.headers``): its header list is built as it is, without
    Starlette's generic pass over every header of every response."""

    media_type = JSON

    def __init__(self, body: bytes, headers: Mapping[str, str]) -> None:
        self.status_code = 200
        self.body = body
        self.background = None
        self.raw_headers = [
            (b"content-length", str(len(body)).encode()),
            (b"content-type", b"application/json"),
            *[(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()],
        ]
