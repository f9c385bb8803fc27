"""The Responses API's state, kept by the gateway (gateway.api.responses), with
the real engine: a response stored through one gateway is found, and
continued with ``previous_response_id``, through another that shares its
state store (``--state-db`` on a real PostgreSQL; each has a state directory
of its own), whichever worker runs the continuation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.conftest import MODEL, Served, start_gateway, stop_serve
from tests.harness.postgres_server import PostgresServer
from tests.integration.streams import events_with_ids

ASK = {"model": MODEL, "max_output_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def replicas(
    served: Served, postgres_server: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Served, Served]]:
    """Two gateways sharing one state store, in front of the session's worker."""
    directory = tmp_path_factory.mktemp("responses")
    url = postgres_server.create_database("responses_state")
    started: list[Served] = []
    try:
        for name in ("a", "b"):
            state = ("--state-dir", str(directory / name), "--state-db", url)
            started.append(
                start_gateway(directory / f"{name}.log", served.worker_addresses(1), *state)
            )
        yield started[0], started[1]
    finally:
        for gateway in started:
            stop_serve(gateway)


def client(gateway: Served) -> OpenAI:
    return OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)


def test_a_response_made_through_one_replica_is_read_through_another(
    replicas: tuple[Served, Served],
) -> None:
    first, second = replicas
    made = client(first).responses.create(input="What is the capital of France?", **ASK)
    found = client(second).responses.retrieve(made.id)
    assert found.id == made.id and found.output_text == made.output_text
    assert found.usage == made.usage


def test_previous_response_id_continues_the_conversation_on_another_replica(
    replicas: tuple[Served, Served],
) -> None:
    first, second = replicas
    made = client(first).responses.create(input="My name is Ada.", **ASK)
    alone = client(second).responses.create(input="What is my name?", **ASK)
    after = client(second).responses.create(
        input="What is my name?", previous_response_id=made.id, **ASK
    )
    assert after.previous_response_id == made.id
    assert alone.usage is not None and after.usage is not None and made.usage is not None
    # The worker read the whole conversation: the first turn, its answer, the question.
    assert after.usage.input_tokens > alone.usage.input_tokens + made.usage.output_tokens
    # And a third turn reaches back through both.
    third = client(first).responses.create(input="Thanks.", previous_response_id=after.id, **ASK)
    assert third.usage is not None
    assert third.usage.input_tokens > after.usage.input_tokens + after.usage.output_tokens


def test_a_streamed_response_is_stored_before_its_last_event(
    replicas: tuple[Served, Served],
) -> None:
    first, second = replicas
    body: dict[str, Any] = {**ASK, "input": "Name a color.", "stream": True}
    final = None
    with httpx.stream("POST", f"{first.base_url}/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and "response.completed" in line:
                final = json.loads(line[6:])["response"]
                break  # read no further: it must already be stored
    assert final is not None
    found = httpx.get(f"{second.base_url}/v1/responses/{final['id']}", timeout=60).json()
    assert found["id"] == final["id"] and found["output"] == final["output"]


def test_store_false_is_not_kept(replicas: tuple[Served, Served]) -> None:
    first, second = replicas
    made = client(first).responses.create(input="Say hi.", store=False, **ASK)
    response = httpx.get(f"{second.base_url}/v1/responses/{made.id}", timeout=60)
    assert response.status_code == 404


def test_an_id_the_store_does_not_hold_is_the_gateways_404(
    replicas: tuple[Served, Served],
) -> None:
    """By id, a response is answered from the store alone, never by a worker's vLLM;
    a stored one has ended, so cancelling it is vLLM's own 400."""
    first, second = replicas
    made = client(first).responses.create(input="Say hi.", **ASK)
    with httpx.Client(base_url=second.base_url, timeout=60) as http:
        for method, path in (
            ("GET", "/v1/responses/resp_unknown"),
            ("POST", "/v1/responses/resp_unknown/cancel"),
        ):
            unknown = http.request(method, path)
            assert unknown.status_code == 404, unknown.text
            assert unknown.json()["error"] == {
                "message": "Response with id 'resp_unknown' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": None,
            }
        cancel = http.post(f"/v1/responses/{made.id}/cancel")
        assert cancel.status_code == 400 and cancel.json()["error"]["param"] == "response_id"


# -- background responses ---------------------------------------------------------------

LONGER = {**ASK, "max_output_tokens": 48}


def test_a_background_response_is_polled_through_another_replica_to_the_same_answer(
    replicas: tuple[Served, Served],
) -> None:
    """It answers at once (queued), runs on its own, and any replica polls it;
    greedy, its text is the one the same request gets in the foreground."""
    first, second = replicas
    question = "Name three rivers."
    made = client(first).responses.create(input=question, background=True, **LONGER)
    assert made.status in ("queued", "in_progress") and made.background
    found = wait_for_end(second, made.id)
    assert found.status in ("completed", "incomplete") and found.background
    assert found.id == made.id and found.created_at == made.created_at
    foreground = client(first).responses.create(input=question, **LONGER)
    assert found.output_text == foreground.output_text and found.output_text
    assert found.usage is not None and found.usage.output_tokens > 0
    # And continued by id, like any stored response.
    after = client(second).responses.create(
        input="Which is longest?", previous_response_id=made.id, **ASK
    )
    assert after.usage is not None and after.usage.input_tokens > found.usage.output_tokens


def wait_for_end(gateway: Served, response_id: str) -> Any:
    """The response once it has ended, polled as a client polls (no clock:
    each poll waits on the stream's next event)."""
    while True:
        found = client(gateway).responses.retrieve(response_id)
        if found.status not in ("queued", "in_progress"):
            return found
        with httpx.stream(
            "GET",
            f"{gateway.base_url}/v1/responses/{response_id}",
            params={"stream": "true"},
            timeout=120,
        ) as stream:
            for _ in stream.iter_lines():
                pass  # read to its end: the response has ended


def test_a_dropped_background_stream_resumes_through_another_replica_once_each(
    replicas: tuple[Served, Served],
) -> None:
    """``starting_after`` resumes after the last event the client read: through
    the other replica, every later event exactly once, and the text whole."""
    first, second = replicas
    body = {**LONGER, "input": "Count from one to twenty.", "background": True, "stream": True}
    read: list[Any] = []
    with httpx.stream("POST", f"{first.base_url}/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                read.append(json.loads(line[6:]))
                if read[-1]["type"] == "response.output_text.delta":
                    break  # the client drops after its first token
    response_id = read[0]["response"]["id"]
    after = read[-1]["sequence_number"]
    resumed = client(second).responses.retrieve(response_id, stream=True, starting_after=after)
    read += [event.model_dump() for event in resumed]
    assert [e["sequence_number"] for e in read] == list(range(len(read)))
    assert read[-1]["type"] in ("response.completed", "response.incomplete")
    text = "".join(e["delta"] for e in read if e["type"] == "response.output_text.delta")
    final = read[-1]["response"]
    assert text and text == final["output"][0]["content"][0]["text"]
    assert client(first).responses.retrieve(response_id).output_text == text


def test_a_resumable_chat_stream_resumes_with_last_event_id_through_another_replica(
    replicas: tuple[Served, Served],
) -> None:
    """``x-llmgate-resumable``: each chunk has an SSE id; after a drop, the same
    request with ``Last-Event-ID`` through the other replica gets every later
    chunk once and ``[DONE]``; greedy, the text is the foreground answer's."""
    first, second = replicas
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to twenty."}],
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
    }
    url = f"{first.base_url}/v1/chat/completions"
    # The client drops after its first text, and resumes through the other.
    read = events_with_ids(url, body, {"x-llmgate-resumable": "true"}, until_pieces=1)
    again = f"{second.base_url}/v1/chat/completions"
    read += events_with_ids(again, body, {"last-event-id": read[-1][0]})
    assert [int(i.split(":")[1]) for i, _ in read[:-1]] == list(range(len(read) - 1))
    assert read[-1] == ("", "[DONE]")
    chunks = [json.loads(data) for _, data in read[:-1]]
    text = "".join((c["delta"].get("content") or "") for chunk in chunks for c in chunk["choices"])
    foreground = client(first).chat.completions.create(
        **{k: v for k, v in body.items() if k != "stream"}
    )
    assert text and text == foreground.choices[0].message.content
