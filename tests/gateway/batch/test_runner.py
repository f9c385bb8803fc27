"""gateway/batch/runner.py's own logic, with a stand-in for the gateway's app: what each
line's request looks like, retries of 429s, cancelling, expiry. (The real request
path runs under tests/integration/test_batches.py.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from gateway.api.auth import KeyRing
from gateway.batch import jsonl, runner
from gateway.batch.runner import Runner
from gateway.context import context_of
from gateway.state import State
from gateway.state.batches import Batches
from gateway.state.tables import batches as batches_table
from shared import api_keys
from shared.settings import SETTINGS_ERROR_STATUS, BatchSettings, StoreSettings, TenantSettings

CHAT = "/v1/chat/completions"

# Two lines in flight at most.
TWO_LINES = BatchSettings(batch_max_inflight=2)


# A 429 without Retry-After, as a line alone over its key's tokens a minute gets.
TOO_LARGE = -429


class App:
    """Answers each request with ``statuses`` in turn (then 200), or holds it until
    its client leaves when ``hold`` is set; records every scope. A 429 or 503
    says when to try again (``Retry-After``), as the gateway's do; ``TOO_LARGE``
    is a 429 without it."""

    def __init__(self, statuses: list[int] | None = None, hold: bool = False) -> None:
        self.statuses = statuses or []
        self.hold = hold
        self.scopes: list[dict[str, Any]] = []
        self.started = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        body = (await receive())["body"]
        self.started.set()
        if self.hold:
            assert (await receive())["type"] == "http.disconnect"
            return  # as the gateway does for a client that left
        status = self.statuses.pop(0) if self.statuses else 200
        headers = [(b"retry-after", b"1")] if status in (429, 503) else []
        status = abs(status)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": json.dumps({"echo": json.loads(body)}).encode()}
        )


async def make(
    tmp_path: Path, app: App, count: int, metadata: dict[str, str] | None = None
) -> tuple[Runner, Batches, str]:
    state = State(StoreSettings(state_dir=str(tmp_path)))
    await state.connect()
    data = "\n".join(
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {"n": i}})
        for i in range(count)
    )
    batch = state.batches.create("file-x", CHAT, "24h", metadata, jsonl.parse(data.encode()))
    return (
        Runner(state, app, lambda: 4, lambda: 1e9, TWO_LINES),
        state.batches,
        batch["id"],
    )


async def finished(store: Batches, batch_id: str) -> dict[str, Any]:
    async with asyncio.timeout(60):  # a hang guard
        while True:
            batch = store.get(batch_id)
            assert batch is not None
            if batch["status"] in ("completed", "cancelled", "expired"):
                return batch
            await asyncio.sleep(0.01)


def content(store: Batches, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in (store.files.content(file_id) or b"").splitlines()]


async def test_each_line_is_a_low_priority_request_and_a_429_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "RETRY_PAUSES", (0.01,))
    app = App(statuses=[429, 400])
    batch_runner, store, batch_id = await make(tmp_path, app, 3)
    batch_runner.start()
    batch = await finished(store, batch_id)
    await batch_runner.stop()
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert len(app.scopes) == 4  # the 429 was not a result
    scope = app.scopes[0]
    headers = dict(scope["headers"])
    assert scope["path"] == CHAT and context_of(scope).batch
    assert headers[b"cache-control"] == b"no-store"  # no precompute asked
    assert headers[b"x-request-id"].startswith(batch_id.encode())
    [error] = content(store, batch["error_file_id"])
    assert error["response"]["status_code"] == 400
    output = content(store, batch["output_file_id"])
    assert [x["response"]["body"]["echo"]["n"] for x in output] == [
        i for i in range(3) if i != error["response"]["body"]["echo"]["n"]
    ]


async def test_a_line_too_large_for_its_keys_limit_fails_at_once(tmp_path: Path) -> None:
    """A 429 without Retry-After (waiting cannot help) is the line's answer, not retried."""
    app = App(statuses=[TOO_LARGE])
    batch_runner, store, batch_id = await make(tmp_path, app, 1)
    batch_runner.start()
    batch = await finished(store, batch_id)
    await batch_runner.stop()
    assert batch["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    assert len(app.scopes) == 1
    [error] = content(store, batch["error_file_id"])
    assert error["response"]["status_code"] == 429


async def test_a_precompute_batch_lets_the_cache_work(tmp_path: Path) -> None:
    app = App()
    batch_runner, store, batch_id = await make(tmp_path, app, 1, {"llmgate_cache": "true"})
    batch_runner.start()
    await finished(store, batch_id)
    await batch_runner.stop()
    assert b"cache-control" not in dict(app.scopes[0]["headers"])


async def test_cancelling_ends_the_lines_in_flight_and_reports_the_rest(tmp_path: Path) -> None:
    app = App(hold=True)
    batch_runner, store, batch_id = await make(tmp_path, app, 5)
    batch_runner.start()
    await app.started.wait()
    store.set_status(batch_id, "cancelling", ("in_progress",))
    batch_runner.wake()
    batch = await finished(store, batch_id)
    await batch_runner.stop()
    assert batch["status"] == "cancelled" and batch["request_counts"]["completed"] == 0
    errors = content(store, batch["error_file_id"])
    assert sorted(x["custom_id"] for x in errors) == [f"c{i}" for i in range(5)]
    assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    assert len(app.scopes) <= 2  # the cap: two in flight, no more started


async def test_lines_not_run_by_the_end_of_the_window_expire(tmp_path: Path) -> None:
    app = App()
    batch_runner, store, batch_id = await make(tmp_path, app, 2)
    with store.db.write() as db:  # a job created a day ago
        db.execute(update(batches_table).values(expires_at=int(time.time()) - 1))
    batch_runner.start()
    batch = await finished(store, batch_id)
    await batch_runner.stop()
    assert batch["status"] == "expired" and not app.scopes
    assert {x["error"]["code"] for x in content(store, batch["error_file_id"])} == {"batch_expired"}


async def test_a_jobs_lines_run_as_its_owners_key_and_a_revoked_one_fails_them(
    tmp_path: Path,
) -> None:
    """A job is owned by its key's id: a name revoked and added again with a new
    secret is another key, and the job's lines do not run as it."""
    path = tmp_path / "keys.yaml"
    api_keys.add(path, "team-a")
    api_keys.add(path, "team-b")
    team_a, team_b = api_keys.load(path)
    api_keys.revoke(path, "team-b")
    api_keys.add(path, "team-b")
    app = App()
    state = State(StoreSettings(state_dir=str(tmp_path)))
    await state.connect()
    line = json.dumps({"custom_id": "c0", "method": "POST", "url": CHAT, "body": {"n": 0}})
    owned = state.batches.create("f", CHAT, "24h", None, jsonl.parse(line.encode()), team_a.id)
    gone = state.batches.create("f", CHAT, "24h", None, jsonl.parse(line.encode()), team_b.id)
    ring = KeyRing(TenantSettings(api_keys_file=str(path)))
    batch_runner = Runner(state, app, lambda: 4, lambda: 1e9, TWO_LINES, ring)
    batch_runner.start()
    await finished(state.batches, owned["id"])
    failed = await finished(state.batches, gone["id"])
    await batch_runner.stop()
    [scope] = app.scopes
    key = context_of(scope).key
    assert key is not None and (key.name, key.id) == ("team-a", team_a.id)
    [error] = content(state.batches, failed["error_file_id"])
    assert error["response"]["status_code"] == 401
    assert "revoked" in error["response"]["body"]["error"]["message"]


class HoldsFirst(App):
    """Holds line 0 (``{"n": 0}``) until ``release`` is set; answers the others
    after a short pause, so the runner keeps claiming lines meanwhile. Records
    which lines it was asked for."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.total = total
        self.release = asyncio.Event()
        self.others_answered = asyncio.Event()
        self.asked: list[int] = []
        self.answered = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        n = json.loads((await receive())["body"])["n"]
        self.asked.append(n)
        if n == 0:
            self.started.set()
            await self.release.wait()
        else:
            await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps({"echo": n}).encode()})
        self.answered += 1
        if self.answered == self.total - 1:
            self.others_answered.set()


async def run_with_line_0_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, renew: bool
) -> tuple[HoldsFirst, list[list[tuple[str, int]]], dict[str, Any]]:
    """100 lines, two at a time, under a 0.3 s lease; line 0 is held until every
    other line has ended. Returns the app, the lines each renewal named while
    the others were still being claimed (``renew`` False: none is made, as for
    a loop late past the lease), and the ended job."""
    app = HoldsFirst(100)
    batch_runner, store, batch_id = await make(tmp_path, app, 100)
    batch_runner.lease_seconds = 0.3
    renewals: list[list[tuple[str, int]]] = []
    lines_class = type(store.lines)
    renew_for_real = lines_class.renew

    def spy(lines: Any, owner: str, lease: float, running: Any) -> int:
        running = list(running)
        if not app.release.is_set():
            renewals.append(running)
        return renew_for_real(lines, owner, lease, running) if renew else 0

    monkeypatch.setattr(lines_class, "renew", spy)
    batch_runner.start()
    await app.started.wait()
    async with asyncio.timeout(60):
        await app.others_answered.wait()
    app.release.set()
    batch = await finished(store, batch_id)
    await batch_runner.stop()
    return app, renewals, batch


async def test_a_running_lines_lease_is_renewed_while_other_lines_are_claimed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claiming new lines does not put off renewing the ones running: a long
    line among many short ones keeps its lease (else another replica takes it
    over and runs it again)."""
    app, renewals, batch = await run_with_line_0_held(tmp_path, monkeypatch, renew=True)
    assert any((batch["id"], 0) in running for running in renewals), renewals
    assert sorted(app.asked) == list(range(100))
    assert batch["request_counts"] == {"total": 100, "completed": 100, "failed": 0}


async def test_a_line_whose_lease_lapsed_while_it_ran_is_not_run_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its loop late past the lease (no renewal here at all), the runner claims
    its own running line again: it renews the lease, it does not start it again."""
    app, _, batch = await run_with_line_0_held(tmp_path, monkeypatch, renew=False)
    assert app.asked.count(0) == 1, app.asked
    assert sorted(app.asked) == list(range(100))
    assert batch["request_counts"] == {"total": 100, "completed": 100, "failed": 0}


def test_a_lease_under_three_seconds_is_refused_at_start() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.main", "--batch-lease-seconds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == SETTINGS_ERROR_STATUS
    assert "--batch-lease-seconds must be at least 3" in done.stderr
