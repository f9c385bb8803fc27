"""``gateway.dialects.jsonresp``: the JSON encoder and the JSON response every route uses."""

from __future__ import annotations

import msgspec

from gateway.dialects import sse
from gateway.dialects.jsonresp import JSON, encode, json_response


def test_a_json_response_carries_the_encoded_value_status_and_headers() -> None:
    response = json_response({"ready": False, "n": [1, 2]}, 503, {"Retry-After": "5"})
    assert response.status_code == 503
    assert response.headers["content-type"] == JSON
    assert response.headers["retry-after"] == "5"
    assert msgspec.json.decode(response.body) == {"ready": False, "n": [1, 2]}


def test_the_default_is_a_200_without_extra_headers() -> None:
    response = json_response([])
    assert response.status_code == 200 and response.body == b"[]"


def test_sse_events_frame_the_same_encoding() -> None:
    assert sse.event({"a": 1}) == b"data: " + encode({"a": 1}) + b"\n\n"
