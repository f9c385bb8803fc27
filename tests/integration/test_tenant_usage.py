"""Usage per key and isolation between keys, end to end: a lone gateway with a YAML keys
file, a state directory and the memory response cache, in front of the session's real
worker.

The usage a key sees at ``GET /v1/usage`` is the sum of the ``usage`` its clients were
given (chat, completions, streams with ``include_usage``, a response cache hit, a
batch's lines); the batch's own ``usage`` is filled in; another key sees none of a
key's files, batches and stored responses, nor takes a stored response's id, and an
admin key sees them all. What a key makes is its id's: a name revoked and added again
with a new secret owns none of it. ``/metrics`` is the admin key's. The flush is waited
for by polling ``/v1/usage`` until it shows the requests, never by sleeping.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from shared import api_keys
from tests.conftest import MODEL, Served, start_gateway, stop_serve
from tests.integration.test_batches import CHAT, create, finished, lines_of, requests, upload
from tests.integration.test_pool import value_in, wait_for

NAMES = ("alice", "bob", "carol", "dave")
CACHE = "x-llmgate-cache"


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gateway's keys file (keys.yaml), log and state directory."""
    return tmp_path_factory.mktemp("tenants")


@pytest.fixture(scope="module")
def tenants(served: Served, directory: Path) -> Iterator[tuple[Served, dict[str, str]]]:
    """The gateway and a key for each name, ``ops`` an admin."""
    path = directory / "keys.yaml"
    keys = {name: api_keys.add(path, name) for name in NAMES}
    keys["ops"] = api_keys.add(path, "ops", admin=True)
    gateway = start_gateway(
        directory / "gateway.log",
        served.worker_addresses(1),
        *("--api-keys-file", str(path), "--state-dir", str(directory / "state")),
        *("--cache", "memory"),
    )
    try:
        yield gateway, keys
    finally:
        stop_serve(gateway)


def http(gateway: Served, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=gateway.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def sdk(gateway: Served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0)


def streamed_usage(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, int]:
    """The usage chunk of a stream with ``stream_options.include_usage``."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return dict(usage)


def run_batch(client: openai.OpenAI, tag: str) -> openai.types.Batch:
    batch_id = create(client, requests(2, max_tokens=3, tag=tag))
    wait_for(lambda: finished(client.batches.retrieve(batch_id).model_dump()), 300)
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "completed", batch
    return batch


def metric(gateway: Served, admin_key: str, name: str, **labels: str) -> float | None:
    """A sample of the gateway's /metrics, which takes an admin key."""
    response = httpx.get(
        f"{gateway.base_url}/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    return value_in(response.text, name, **labels)


def usage_of(client: httpx.Client, **filters: str) -> dict[str, Any]:
    response = client.get("/v1/usage", params=filters)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_the_usage_a_key_sees_is_what_its_clients_were_given(
    tenants: tuple[Served, dict[str, str]], directory: Path
) -> None:
    gateway, keys = tenants
    alice = http(gateway, keys["alice"])
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Usage test: say hi."}],
        "max_tokens": 3,
        "temperature": 0,
    }
    completion = {"model": MODEL, "prompt": "Usage test: one two", "max_tokens": 3, "seed": 1}
    given: list[dict[str, int]] = []
    first = alice.post("/v1/chat/completions", json=chat)
    assert first.status_code == 200 and first.headers[CACHE] == "miss"
    given.append(first.json()["usage"])
    hit = alice.post("/v1/chat/completions", json=chat)
    assert hit.headers[CACHE] == "hit"
    given.append(hit.json()["usage"])
    given.append(alice.post("/v1/completions", json=completion).json()["usage"])
    given.append(streamed_usage(alice, "/v1/chat/completions", {**chat, "temperature": 0.5}))
    given.append(streamed_usage(alice, "/v1/completions", {**completion, "seed": 2}))
    batch = run_batch(sdk(gateway, keys["alice"]), "alice")
    answers = [
        line["response"]["body"]["usage"]
        for line in lines_of(sdk(gateway, keys["alice"]), batch.output_file_id)
    ]
    given += answers

    # The batch's usage: the sum of its answers'.
    assert batch.usage is not None
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in answers)
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in answers)
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens

    # Flushed within a few seconds: wait until /v1/usage shows every request.
    wait_for(lambda: usage_of(alice)["total"]["requests"] == len(given), 60)
    seen = usage_of(alice)
    prompt = sum(u["prompt_tokens"] for u in given)
    completion_tokens = sum(u["completion_tokens"] for u in given)
    hit_tokens = given[1]["prompt_tokens"] + given[1]["completion_tokens"]
    assert seen["total"] == {
        "requests": len(given),
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "cached_tokens": hit_tokens,
        "total_tokens": prompt + completion_tokens,
    }
    [row] = seen["data"]
    assert (row["object"], row["key"], row["model"]) == ("usage", "alice", MODEL)
    assert row["key_id"] == next(
        e.id for e in api_keys.load(directory / "keys.yaml") if e.name == "alice"
    )
    assert row["requests"] == len(given)
    # Prometheus counts by key, at once.
    ops_key = keys["ops"]
    assert (
        metric(gateway, ops_key, "llmgate_key_tokens_total", key="alice", type="prompt") == prompt
    )
    assert (
        metric(gateway, ops_key, "llmgate_key_tokens_total", key="alice", type="cached")
        == hit_tokens
    )

    # Another key sees none of it (and may not ask for it); an admin sees it, by filter too.
    carol = http(gateway, keys["carol"])
    assert usage_of(carol)["data"] == []
    assert carol.get("/v1/usage", params={"key": "alice"}).status_code == 400
    ops = http(gateway, keys["ops"])
    assert (
        usage_of(ops, key="alice", model=MODEL, start_date=row["date"], end_date=row["date"])
        == seen
    )
    assert usage_of(ops, end_date="2000-01-01")["data"] == []
    for bad in (
        {"start_date": "yesterday"},
        {"start_time": "0"},
        {"start_date": "2030-01-02", "end_date": "2030-01-01"},
    ):
        response = ops.get("/v1/usage", params=bad)
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == next(iter(bad))


def test_files_batches_and_responses_are_their_keys(
    tenants: tuple[Served, dict[str, str]],
) -> None:
    gateway, keys = tenants
    bob, carol, ops = (sdk(gateway, keys[name]) for name in ("bob", "carol", "ops"))
    batch = run_batch(bob, "bob")
    input_id, output_id = batch.input_file_id, batch.output_file_id
    assert output_id is not None and bob.files.retrieve(output_id).purpose == "batch_output"

    # Another key: 404 for each, and absent from its lists.
    for file_id in (input_id, output_id):
        with pytest.raises(openai.NotFoundError):
            carol.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            carol.files.content(file_id)
        with pytest.raises(openai.NotFoundError):
            carol.files.delete(file_id)
    with pytest.raises(openai.NotFoundError):
        carol.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        carol.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        carol.batches.create(input_file_id=input_id, endpoint=CHAT, completion_window="24h")
    own = upload(carol, requests(1))
    assert [f.id for f in carol.files.list()] == [own]
    assert [b.id for b in carol.batches.list()] == []
    # Another key's id as a list's cursor is an unknown one: an empty page.
    assert [f.id for f in carol.files.list(after=output_id, order="asc")] == []
    assert [f.id for f in carol.files.list(after=input_id)] == []

    # An admin sees them all.
    assert {input_id, output_id, own} <= {f.id for f in ops.files.list()}
    assert batch.id in [b.id for b in ops.batches.list()]
    assert ops.batches.retrieve(batch.id).usage is not None
    assert ops.files.content(output_id).text == bob.files.content(output_id).text

    # A stored response: unknown to another key, by id and as previous_response_id.
    ask = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    made = bob.responses.create(input="Name a color.", **ask)
    assert bob.responses.retrieve(made.id).id == made.id
    assert ops.responses.retrieve(made.id).id == made.id
    raw = http(gateway, keys["carol"])
    unknown = raw.get("/v1/responses/resp_not_a_known_one")
    theirs = raw.get(f"/v1/responses/{made.id}")
    assert theirs.status_code == unknown.status_code == 404
    body = {**ask, "input": "And now?"}
    unknown = raw.post("/v1/responses", json={**body, "previous_response_id": "resp_nope"})
    theirs = raw.post("/v1/responses", json={**body, "previous_response_id": made.id})
    assert theirs.status_code == unknown.status_code and theirs.status_code >= 400
    assert bob.responses.create(input="And now?", previous_response_id=made.id, **ask).id


def test_metrics_are_the_admin_keys(tenants: tuple[Served, dict[str, str]]) -> None:
    """Every key's usage is in /metrics: no key but an admin's reads it."""
    gateway, keys = tenants
    anonymous = httpx.get(f"{gateway.base_url}/metrics", timeout=60)
    assert anonymous.status_code == 401
    refused = http(gateway, keys["alice"]).get("/metrics")
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert "llmgate_key_requests_total" in http(gateway, keys["ops"]).get("/metrics").text
    assert httpx.get(f"{gateway.base_url}/health", timeout=60).status_code == 200


def test_another_keys_response_id_cannot_be_taken(
    tenants: tuple[Served, dict[str, str]],
) -> None:
    """vLLM's ``request_id`` names the response: another key choosing a stored
    response's id replaced it."""
    gateway, keys = tenants
    bob = sdk(gateway, keys["bob"])
    ask = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    made = bob.responses.create(input="Name a fruit.", **ask)
    carol = http(gateway, keys["carol"])
    body = {**ask, "input": "Say something else.", "request_id": made.id}
    refused = carol.post("/v1/responses", json=body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "request_id"
    assert bob.responses.retrieve(made.id).output_text == made.output_text
    # Cancelling it, by id, is as for an unknown one: 404 from the gateway.
    assert carol.post(f"/v1/responses/{made.id}/cancel").status_code == 404


def test_a_name_revoked_and_added_again_owns_nothing_of_the_old_keys(
    tenants: tuple[Served, dict[str, str]], directory: Path
) -> None:
    """Owners were key names: a new secret under an old name took over its
    usage, files, batches and stored responses."""
    gateway, keys = tenants
    path = directory / "keys.yaml"
    old = http(gateway, keys["dave"])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi, Dave."}], "max_tokens": 2}
    assert old.post("/v1/chat/completions", json=chat).status_code == 200
    file_id = upload(sdk(gateway, keys["dave"]), requests(1))
    made = sdk(gateway, keys["dave"]).responses.create(
        input="Name a tree.", model=MODEL, max_output_tokens=4, temperature=0
    )
    wait_for(lambda: usage_of(old)["total"]["requests"] >= 1, 60)
    old_id = next(e.id for e in api_keys.load(path) if e.name == "dave")

    api_keys.revoke(path, "dave")
    new_key = api_keys.add(path, "dave")
    new = http(gateway, new_key)
    # The gateway re-reads the file within seconds: until the new key is let in.
    wait_for(lambda: new.get("/v1/models").status_code == 200, 60)
    assert old.get("/v1/models").status_code == 401
    assert usage_of(new, key="dave")["data"] == []
    assert new.get("/v1/files").json()["data"] == []
    assert new.get(f"/v1/files/{file_id}").status_code == 404
    assert new.get(f"/v1/responses/{made.id}").status_code == 404
    assert (
        new.post(
            "/v1/responses", json={"model": MODEL, "input": "x", "request_id": made.id}
        ).status_code
        == 400
    )
    # An admin still sees the old key's, under the name, by its id.
    ops = http(gateway, keys["ops"])
    assert {row["key_id"] for row in usage_of(ops, key="dave")["data"]} == {old_id}
    assert ops.get(f"/v1/files/{file_id}").status_code == 200
