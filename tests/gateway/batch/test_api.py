"""gateway/batch/api.py with API keys: files and batches are their key's, by the key's
id; a name revoked and added again owns none of them; a list's cursor is one of the
caller's own items or an unknown one."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from shared import api_keys
from tests.gateway.api.keyed import keyed

CHAT = "/v1/chat/completions"
LINE = {"custom_id": "c0", "method": "POST", "url": CHAT, "body": {"model": "m"}}


async def upload(client: httpx.AsyncClient) -> str:
    response = await client.post(
        "/v1/files",
        files={"file": ("in.jsonl", json.dumps(LINE).encode())},
        data={"purpose": "batch"},
    )
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


async def create(client: httpx.AsyncClient, file_id: str) -> str:
    body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    response = await client.post("/v1/batches", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


async def ids(client: httpx.AsyncClient, path: str, **params: str) -> list[str]:
    response = await client.get(path, params=params)
    assert response.status_code == 200, response.text
    return [item["id"] for item in response.json()["data"]]


async def test_a_name_added_again_owns_none_of_the_old_keys_files_and_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Owners were key names: revoking a name and adding it again with a new
    secret handed the new key everything the old one had made."""
    async with keyed(tmp_path, monkeypatch) as gateway:
        async with gateway.client("team-a") as old:
            file_id = await upload(old)
            batch_id = await create(old, file_id)
            assert await ids(old, "/v1/files") == [file_id]
        gateway.add_again("team-a")
        async with gateway.client("team-a") as new:
            assert await ids(new, "/v1/files") == []
            assert await ids(new, "/v1/batches") == []
            assert (await new.get(f"/v1/files/{file_id}")).status_code == 404
            assert (await new.get(f"/v1/files/{file_id}/content")).status_code == 404
            assert (await new.get(f"/v1/batches/{batch_id}")).status_code == 404
            assert (await new.post(f"/v1/batches/{batch_id}/cancel")).status_code == 404
        async with gateway.client("ops") as ops:  # an admin still sees them
            assert file_id in await ids(ops, "/v1/files")
            assert batch_id in await ids(ops, "/v1/batches")


async def test_a_cursor_naming_another_keys_item_is_an_unknown_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``after=`` paged on from another key's file or batch: proof that it exists."""
    async with keyed(tmp_path, monkeypatch) as gateway:
        async with gateway.client("team-a") as a, gateway.client("team-b") as b:
            first = await upload(a)
            theirs = await upload(b)
            await upload(a)
            mine_batch = await create(a, first)
            their_batch = await create(b, theirs)
            await create(a, first)
            for order in ("asc", "desc"):
                unknown = await ids(a, "/v1/files", after="file-unknown", order=order)
                assert await ids(a, "/v1/files", after=theirs, order=order) == unknown == []
            assert await ids(a, "/v1/batches", after=their_batch) == []
            assert await ids(a, "/v1/batches", after="batch_unknown") == []
            assert len(await ids(a, "/v1/files", after=first, order="asc")) == 1  # its own: a place
            assert await ids(a, "/v1/batches", after=mine_batch) == []


async def test_a_keys_uploads_stop_at_its_quota_and_another_key_is_not_held_by_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = len(json.dumps(LINE))
    async with keyed(tmp_path, monkeypatch, file_quota_bytes=2 * size) as gateway:
        async with gateway.client("team-a") as team_a, gateway.client("team-b") as team_b:
            kept = [await upload(team_a), await upload(team_a)]
            refused = await team_a.post(
                "/v1/files",
                files={"file": ("in.jsonl", json.dumps(LINE).encode())},
                data={"purpose": "batch"},
            )
            assert refused.status_code == 413, refused.text
            assert "--file-quota-bytes" in refused.json()["error"]["message"]
            await upload(team_b)  # its own quota
            # Deleting makes room again.
            assert (await team_a.delete(f"/v1/files/{kept[0]}")).status_code == 200
            await upload(team_a)


async def test_an_upload_is_one_of_its_keys_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with keyed(tmp_path, monkeypatch) as gateway:
        gateway.keys["metered"] = api_keys.add(gateway.path, "metered", requests_per_minute=1)
        async with gateway.client("metered") as metered:
            await upload(metered)
            refused = await metered.post(
                "/v1/files",
                files={"file": ("in.jsonl", json.dumps(LINE).encode())},
                data={"purpose": "batch"},
            )
            assert refused.status_code == 429, refused.text
