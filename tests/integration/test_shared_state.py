"""Gateway replicas sharing one state store (``--state-db`` on a real PostgreSQL),
each with a state directory of its own, in front of the session's real worker:
files, batches and their outputs, and the lines of one job, are every replica's;
a replica killed mid-batch loses no line and doubles none; replicas starting at
once against an empty database migrate it once; a store outage answers 503 on
the state routes only.

Progress is watched through the API (``request_counts``) and the gateways'
metrics and logs, never through sleeps.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.state.db import Database
from gateway.state.tables import MIGRATIONS
from shared.ports import free_port
from tests.conftest import MODEL, ROOT, Served, gateway_pair, start_gateway, stop_serve
from tests.harness.at_once import at_once, raised
from tests.harness.postgres_server import PostgresServer
from tests.integration.test_batches import (
    COMPLETIONS,
    SHORT_LEASE,
    assert_only_held_lines_ran_twice,
    client_of,
    committed_by,
    create,
    engine_runs,
    finished,
    lines_of,
    requests,
    upload,
    wait_until,
)
from tests.integration.test_pool import metric, wait_for


def replica(tmp_path: Path, served: Served, name: str, url: str, *flags: str) -> Served:
    """A lone gateway with a state directory of its own on the shared ``url``."""
    state = ("--state-dir", str(tmp_path / f"{name}-state"), "--state-db", url)
    return start_gateway(tmp_path / f"{name}.log", served.worker_addresses(1), *state, *flags)


@pytest.fixture
def database(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> str:
    return postgres_server.create_database(request.node.name.lower()[:48])


@pytest.fixture
def pair(served: Served, tmp_path: Path, database: str) -> Iterator[tuple[Served, Served]]:
    def state(name: str) -> tuple[str, ...]:
        return ("--state-dir", str(tmp_path / f"{name}-state"), "--state-db", database)

    with gateway_pair(served, tmp_path, "--batch-max-inflight", "4", each=state) as both:
        yield both


def completed_lines(gateway: Served) -> float:
    return metric(gateway.base_url, "llmgate_batch_lines_total", status="completed")


def test_a_file_uploaded_through_one_replica_is_the_others(pair: tuple[Served, Served]) -> None:
    one, other = (client_of(g) for g in pair)
    file_id = upload(one, requests(2))
    assert file_id in [f.id for f in other.files.list()]
    assert other.files.retrieve(file_id).bytes > 0
    assert other.files.content(file_id).text.count("\n") == 2
    assert other.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        one.files.retrieve(file_id)


def test_a_200_line_batch_created_through_one_replica_is_run_by_both(
    served: Served, pair: tuple[Served, Served]
) -> None:
    first, second = pair
    total = 200
    batch_id = create(client_of(first), requests(total, max_tokens=4, url=COMPLETIONS))
    assert client_of(second).batches.retrieve(batch_id).id == batch_id
    wait_until(second, batch_id, finished, timeout=900)
    batch = client_of(second).batches.retrieve(batch_id)
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (total, 0)
    output = lines_of(client_of(first), batch.output_file_id)
    assert [x["custom_id"] for x in output] == [f"req-{i}" for i in range(total)]
    # Each line ran once on the engine, by one replica or the other (a line
    # both ran would be committed once), and both worked on the job (each
    # holds at most 4 of its 200 lines at a time).
    assert engine_runs(served, batch_id) == {f"req-{i}": 1 for i in range(total)}
    done = [completed_lines(first), completed_lines(second)]
    assert min(done) > 0, done


def test_a_batch_created_through_one_replica_is_cancelled_through_the_other(
    pair: tuple[Served, Served],
) -> None:
    first, second = pair
    # Line 0 is short; the others ask 1,000 tokens each, so the job is far
    # from done when the cancel lands, however late the test sees line 0.
    items = [*requests(1), *requests(20, max_tokens=1000, ignore_eos=True)[1:]]
    batch_id = create(client_of(first), items)
    wait_until(first, batch_id, lambda b: b["request_counts"]["completed"] >= 1)
    assert client_of(second).batches.cancel(batch_id).status in ("cancelling", "cancelled")
    wait_until(first, batch_id, finished, timeout=120)
    batch = client_of(first).batches.retrieve(batch_id)
    assert batch.status == "cancelled"
    answered = lines_of(client_of(second), batch.output_file_id)
    not_run = lines_of(client_of(second), batch.error_file_id)
    assert {x["error"]["code"] for x in not_run} == {"batch_cancelled"}
    ids = sorted(x["custom_id"] for x in answered + not_run)
    assert ids == sorted(f"req-{i}" for i in range(20))
    # Both replicas' lines in flight were aborted, not left running.
    for gateway in pair:
        wait_for(lambda g=gateway: metric(g.base_url, "llmgate_requests_in_flight") == 0, 60)


def test_a_replica_killed_mid_batch_leaves_its_lines_to_the_other_with_none_doubled(
    served: Served, tmp_path: Path, database: str
) -> None:
    """Outcomes only: whenever the kill lands, the survivor ends the job whole
    and nothing the victim committed ran again. Where the kill lands exactly
    (two held lines left to the survivor): tests/faults/test_batches.py."""
    victim = replica(
        tmp_path, served, "victim", database, "--batch-max-inflight", "2", *SHORT_LEASE
    )
    total = 30
    try:
        batch_id = create(client_of(victim), requests(total, max_tokens=16))
        wait_until(victim, batch_id, lambda b: b["request_counts"]["completed"] >= 3)
        survivor = replica(
            tmp_path, served, "survivor", database, "--batch-max-inflight", "4", *SHORT_LEASE
        )
    finally:
        stop_serve(victim, signal.SIGKILL)
    try:
        wait_until(survivor, batch_id, finished, timeout=600)
        batch = client_of(survivor).batches.retrieve(batch_id)
        assert batch.status == "completed" and batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (total, 0)
        output = lines_of(client_of(survivor), batch.output_file_id)
        assert [x["custom_id"] for x in output] == [f"req-{i}" for i in range(total)]
        store = Database(database, tmp_path)
        victims = committed_by(store, batch_id, victim.proc.pid)
        store.close()
        assert len(victims) >= 3
        # On the engine, what the victim committed ran once; only the lines it
        # had in flight at the kill (--batch-max-inflight 2) ran again.
        assert_only_held_lines_ran_twice(engine_runs(served, batch_id), total, victims, held=2)
    finally:
        stop_serve(survivor)


def test_replicas_starting_at_once_on_an_empty_database_migrate_it_once(
    served: Served, tmp_path: Path, database: str
) -> None:
    results = at_once(3, lambda i: replica(tmp_path, served, f"r{i}", database))
    started = [r for r in results if isinstance(r, Served)]
    try:
        assert not raised(results), results
        applied = [g.log_path.read_text().count("applied migration") for g in started]
        assert sorted(applied) == [0, 0, len(MIGRATIONS)], applied
    finally:
        for gateway in started:
            stop_serve(gateway)


def test_previous_response_id_continues_on_another_replica(pair: tuple[Served, Served]) -> None:
    first, second = pair
    ask = {"model": MODEL, "max_output_tokens": 12, "temperature": 0}
    made = client_of(first).responses.create(input="My name is Ada. Say hi.", **ask)
    assert client_of(second).responses.retrieve(made.id).id == made.id
    follow = client_of(second).responses.create(
        input="What is my name?", previous_response_id=made.id, **ask
    )
    assert follow.previous_response_id == made.id
    assert follow.status in ("completed", "incomplete")  # 12 tokens may cut it short
    assert client_of(first).responses.retrieve(follow.id).previous_response_id == made.id


def test_a_store_outage_answers_503_on_state_routes_only(
    served: Served, tmp_path: Path, postgres_server: PostgresServer, database: str
) -> None:
    gateway = replica(tmp_path, served, "outage", database)
    client = client_of(gateway)
    file_id = upload(client, requests(1))
    postgres_server.stop()
    try:
        down = httpx.get(f"{gateway.base_url}/v1/files/{file_id}", timeout=60)
        assert down.status_code == 503
        assert down.json()["error"]["code"] == "state_store_unavailable"
        assert httpx.get(f"{gateway.base_url}/ready", timeout=60).status_code == 200
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content is not None
    finally:
        postgres_server.start()
    try:
        assert client.files.retrieve(file_id).id == file_id  # back, nothing lost
    finally:
        stop_serve(gateway)


def test_a_replica_is_not_ready_until_its_store_answers(
    served: Served, tmp_path: Path, postgres_server: PostgresServer
) -> None:
    unreachable = postgres_server.create_database("never").replace(
        f":{postgres_server.port}/", ":1/"
    )
    port = free_port()
    log_path = tmp_path / "waiting.log"
    argv = [sys.executable, "-m", "gateway.main", "--workers", served.worker_addresses(1)]
    argv += ["--port", str(port), "--state-dir", str(tmp_path / "s"), "--state-db", unreachable]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: "does not answer" in log_path.read_text(), 120)
        # Its worker is healthy; the store is what it waits for.
        wait_for(lambda: _get(base, "/health").json()["healthy_workers"] == 1, 120)
        ready = _get(base, "/ready")
        assert ready.status_code == 503 and "does not answer" in ready.json()["state_store"]
        files = _get(base, "/v1/files")
        assert files.status_code == 503
        assert files.json()["error"]["code"] == "state_store_unavailable"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _get(base: str, path: str) -> httpx.Response:
    try:
        return httpx.get(base + path, timeout=60)
    except httpx.TransportError:
        return httpx.Response(599, json={"healthy_workers": 0})
