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


async def test_a_background_response_is_its_keys_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another key may not read it, follow its events or cancel it (404, as
    for an unknown id); its own key cancels it, once; ``store: false`` with
    ``background`` is refused (a background response is always stored)."""
    async with keyed(tmp_path, monkeypatch) as gateway:
        body = {"model": "m", "input": "hi", "background": True}
        async with gateway.client("team-a") as client:
            refused = await client.post("/v1/responses", json={**body, "store": False})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"
            # An id of its own is kept short: the store's notices carry it.
            for chosen in ("r" * 129, "two words"):
                refused = await client.post("/v1/responses", json={**body, "request_id": chosen})
                assert refused.status_code == 400
                assert refused.json()["error"]["param"] == "request_id"
            made = await client.post("/v1/responses", json=body)
            assert made.status_code == 200, made.text
            response = made.json()
            assert (response["status"], response["background"]) == ("queued", True)
        response_id = response["id"]
        async with gateway.client("team-b") as other:
            for method, path in (
                ("GET", f"/v1/responses/{response_id}"),
                ("GET", f"/v1/responses/{response_id}?stream=true"),
                ("POST", f"/v1/responses/{response_id}/cancel"),
            ):
                answer = await other.request(method, path)
                assert answer.status_code == 404, (method, path, answer.text)
        async with gateway.client("team-a") as client:
            cancelled = await client.post(f"/v1/responses/{response_id}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["status"] == "cancelled"
            again = await client.post(f"/v1/responses/{response_id}/cancel")
            assert again.json()["status"] == "cancelled"
            assert (await client.get(f"/v1/responses/{response_id}")).json()["status"] == (
                "cancelled"
            )
            # Its stream ends: a cancelled response gets no more events.
            events = await client.get(f"/v1/responses/{response_id}?stream=true")
            assert events.status_code == 200 and "response.completed" not in events.text
            bad = await client.get(f"/v1/responses/{response_id}?stream=true&starting_after=x")
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"
