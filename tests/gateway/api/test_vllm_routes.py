"""gateway/api/vllm_routes.py's stored responses with API keys: a response id is its
key's. Another key may not take it with ``request_id`` (400, before anything runs),
nor read or cancel it; an id the store does not hold is a 404 from the gateway, never
a question to a worker's vLLM server (no pool here: a forwarded request would fail)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from gateway.api.responses import Record
from tests.gateway.api.keyed import Keyed, keyed

RESPONSE = {"id": "resp_a", "object": "response", "status": "completed", "output": []}


def stored(gateway: Keyed) -> bytes:
    record = gateway.store.responses.get("resp_a")
    assert record is not None
    return record


async def keep_one(gateway: Keyed) -> bytes:
    record = msgspec.json.encode(Record(RESPONSE, []))
    gateway.store.responses.put("resp_a", record, gateway.id_of("team-a"))
    return record


async def test_another_keys_response_id_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``request_id`` names the response: any key could replace another's."""
    async with keyed(tmp_path, monkeypatch) as gateway:
        record = await keep_one(gateway)
        async with gateway.client("team-b") as other:
            body = {"model": "m", "input": "hi", "request_id": "resp_a"}
            refused = await other.post("/v1/responses", json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", "request_id")
            # store: false keeps nothing, but the id would still name another's response.
            again = await other.post("/v1/responses", json={**body, "store": False})
            assert again.status_code == 400
        assert stored(gateway) == record


@pytest.mark.parametrize("caller", ["team-b", "ops"])
async def test_an_id_not_the_callers_is_404_and_never_forwarded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caller: str
) -> None:
    async with keyed(tmp_path, monkeypatch) as gateway:
        await keep_one(gateway)
        async with gateway.client(caller) as client:
            for response_id in ("resp_unknown", "resp_a"):
                for method, path in (
                    ("GET", f"/v1/responses/{response_id}"),
                    ("POST", f"/v1/responses/{response_id}/cancel"),
                ):
                    answer = await client.request(method, path)
                    if caller == "ops" and response_id == "resp_a":
                        continue  # an admin's: below
                    assert answer.status_code == 404, (method, path, answer.text)
                    error = answer.json()["error"]
                    assert error["message"] == f"Response with id '{response_id}' not found."
                    assert (error["type"], error["param"]) == (
                        "invalid_request_error",
                        "response_id",
                    )


async def test_the_owner_reads_its_response_and_cannot_cancel_a_finished_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with keyed(tmp_path, monkeypatch) as gateway:
        await keep_one(gateway)
        for name in ("team-a", "ops"):
            async with gateway.client(name) as client:
                assert (await client.get("/v1/responses/resp_a")).json() == RESPONSE
                # What vLLM's server answers for a response that is not running.
                cancel = await client.post("/v1/responses/resp_a/cancel")
                assert cancel.status_code == 400
                assert cancel.json()["error"]["param"] == "response_id"


async def test_a_background_response_is_refused_since_no_replica_could_poll_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM keeps it in the one worker process that runs it, owned by no key."""
    async with keyed(tmp_path, monkeypatch) as gateway:
        async with gateway.client("team-a") as client:
            body = {"model": "m", "input": "hi", "background": True}
            refused = await client.post("/v1/responses", json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "background"
