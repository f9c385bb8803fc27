"""gateway/api/resumable.py with API keys: a resumable stream is its key's.

No pool and no runner here: the runner's wake ends every stream at once
(completed, no events), which is all these need (the runs:
tests/faults/test_background.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import update

from gateway.state.tables import background
from tests.gateway.api.keyed import keyed

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True}


async def test_another_key_cannot_resume_a_stream_and_a_bad_id_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with keyed(tmp_path, monkeypatch) as gateway:

        def end_every_stream() -> None:
            with gateway.store.db.write() as db:
                db.execute(update(background).values(status="completed"))

        gateway.api.services.background.wake = end_every_stream
        async with gateway.client("team-a") as client:
            opt_in = {"x-llmgate-resumable": "true"}
            async with client.stream(
                "POST", "/v1/chat/completions", json=CHAT, headers=opt_in
            ) as made:
                assert made.status_code == 200
                assert made.headers["content-type"].startswith("text/event-stream")
                assert (await made.aread()) == b"data: [DONE]\n\n"
                stream_id = made.headers["x-llmgate-stream-id"]
            resumed = {"last-event-id": f"{stream_id}:0"}
            async with client.stream(
                "POST", "/v1/chat/completions", json={}, headers=resumed
            ) as again:
                assert again.status_code == 200  # its own
                assert (await again.aread()) == b"data: [DONE]\n\n"
            bad = await client.post(
                "/v1/chat/completions", json={}, headers={"last-event-id": "no-number"}
            )
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"]["param"] == "Last-Event-ID"
            # A chat stream's id is no completion stream's.
            other_route = await client.post("/v1/completions", json={}, headers=resumed)
            assert other_route.status_code == 404
        for name in ("team-b",):
            async with gateway.client(name) as other:
                refused = await other.post("/v1/chat/completions", json={}, headers=resumed)
                assert refused.status_code == 404, refused.text
