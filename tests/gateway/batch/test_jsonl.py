"""gateway/batch/jsonl.py: what a batch input file may hold, and the 400s for the rest."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway import errors
from gateway.batch import jsonl

CHAT = "/v1/chat/completions"


def request(custom_id: str, url: str = CHAT, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
    }


def jsonl_of(*items: Any) -> bytes:
    return "\n".join(x if isinstance(x, str) else json.dumps(x) for x in items).encode()


def refused(data: bytes) -> str:
    with pytest.raises(errors.BadRequest) as caught:
        jsonl.parse(data)
    return caught.value.message


def test_lines_keep_their_order_body_and_id_and_blank_lines_are_skipped() -> None:
    data = jsonl_of(request("a"), "", request("b", max_tokens=3)) + b"\n"
    lines = jsonl.parse(data)
    assert [(x.index, x.custom_id, x.url) for x in lines] == [(0, "a", CHAT), (1, "b", CHAT)]
    assert json.loads(lines[1].body)["max_tokens"] == 3


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("not json", "Line 2 of the file"),
        ("[1, 2]", "must be a JSON object"),
        ({**request("x"), "custom_id": ""}, "`custom_id` must be a non-empty string"),
        ({**request("x"), "custom_id": "a\x00b"}, "must not contain a NUL character"),
        ({**request("x"), "method": "GET"}, "`method` must be POST"),
        ({**request("x"), "url": 3}, "`url` must be a string"),
        ({**request("x"), "body": "text"}, "`body` must be a JSON object"),
        (request("x", stream=True), "`stream` is not supported"),
        (request("a"), "also that of line 1"),
    ],
)
def test_a_bad_line_is_a_400_naming_it(bad: Any, says: str) -> None:
    message = refused(jsonl_of(request("a"), bad))
    assert "Line 2 of the file" in message and says in message


def test_an_empty_file_is_refused() -> None:
    assert "holds no request" in refused(b"\n\n")


def test_too_many_lines_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonl, "MAX_LINES", 2)
    assert "more than 2 requests" in refused(jsonl_of(request("a"), request("b"), request("c")))


def test_the_batch_endpoint_window_and_every_url_are_checked() -> None:
    lines = jsonl.parse(jsonl_of(request("a"), request("b", url="/v1/completions")))
    with pytest.raises(errors.BadRequest, match="endpoint"):
        jsonl.check_batch(lines, "/v1/embeddings", "24h")
    with pytest.raises(errors.BadRequest, match="completion_window"):
        jsonl.check_batch(lines, CHAT, "1h")
    with pytest.raises(errors.BadRequest, match=r"Request 2 \('b'\) has url '/v1/completions'"):
        jsonl.check_batch(lines, CHAT, "24h")
    assert jsonl.check_batch(lines[:1], CHAT, "24h") == CHAT


def test_metadata_follows_openai_rules() -> None:
    assert jsonl.check_metadata(None) is None
    assert jsonl.check_metadata({"llmgate_cache": "true"}) == {"llmgate_cache": "true"}
    for bad in ({"k": 1}, {str(i): "v" for i in range(17)}, ["x"], {"k" * 65: "v"}):
        with pytest.raises(errors.BadRequest, match="metadata"):
            jsonl.check_metadata(bad)
