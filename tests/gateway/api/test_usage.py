"""gateway/api/usage_routes.py with API keys: a key's usage is its id's, shown under its name;
a name revoked and added again starts from nothing; an admin filters by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.state.usage import Counts
from tests.gateway.api.keyed import keyed

DAY = "2025-06-01"


async def test_a_name_added_again_sees_none_of_the_old_keys_usage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with keyed(tmp_path, monkeypatch) as gateway:
        old_id = gateway.id_of("team-a")
        gateway.store.usage.add("f1", {(old_id, "m", DAY): Counts(3, 30, 3, 0)}, {old_id: "team-a"})
        async with gateway.client("team-a") as old:
            [row] = (await old.get("/v1/usage")).json()["data"]
            assert (row["key"], row["key_id"], row["requests"]) == ("team-a", old_id, 3)
        gateway.add_again("team-a")
        async with gateway.client("team-a") as new:
            answer = (await new.get("/v1/usage", params={"key": "team-a"})).json()
            assert answer["data"] == [] and answer["total"]["requests"] == 0
            # Its own name is the only one it may ask for.
            refused = await new.get("/v1/usage", params={"key": "team-b"})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "key"
        async with gateway.client("ops") as ops:  # an admin asks by name: the old key's rows
            [row] = (await ops.get("/v1/usage", params={"key": "team-a"})).json()["data"]
            assert (row["key"], row["key_id"]) == ("team-a", old_id)
