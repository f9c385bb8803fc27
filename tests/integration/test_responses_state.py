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
