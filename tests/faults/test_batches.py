"""A gateway killed mid-batch, on the held double: no line lost, none doubled.

The job's first three lines ask for fewer tokens than the double sends
before its gate (``HOLD_AFTER``), so they run straight through; every later
line is held at the worker until the test says ``release``. When the kill
lands, exactly three lines are committed and the next ones are under way,
whatever the machine's speed, so the resume is checked exactly: what ran
twice is counted at the worker (the store commits a line once, however
often it ran). The same faults on the real engine, asserting outcomes only:
tests/integration/test_batches.py (one gateway) and test_shared_state.py
(replicas).
"""

from __future__ import annotations

import re
import signal
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import func, select

from gateway.state.db import Database
from gateway.state.tables import lines
from tests.conftest import Served, start_gateway, stop_serve
from tests.faults.held import HOLD_AFTER, HeldWorker, held_worker, running_at
from tests.harness.postgres_server import PostgresServer
from tests.harness.waiting import wait_until
from tests.integration.test_batches import (
    SHORT_LEASE,
    client_of,
    committed,
    create,
    finished,
    lines_of,
    requests,
)
from tests.integration.test_batches import (
    wait_until as wait_for_batch,
)

TOTAL = 12
# Lines that never reach the gate: committed before any fault.
THROUGH = 3


def job() -> list[dict[str, object]]:
    """TOTAL lines; the first THROUGH end before the gate, the rest are held there."""
    held = requests(TOTAL, max_tokens=HOLD_AFTER + 2)
    return [*requests(THROUGH, max_tokens=HOLD_AFTER), *held[THROUGH:]]


# The held worker logs at debug: a line for each request it takes, with the
# request's id (worker/server.py, "running a ... request"), read by ``runs_at``.
DEBUG = ("--log-level", "debug")


def runs_at(worker: HeldWorker, batch_id: str) -> dict[str, int]:
    """How many times ``worker`` took each line of the job, by custom_id
    (``req-N`` is line N): the batch runner's request id for a line is
    ``{batch_id}-{line}`` (with a gateway's ``~n`` when it sent it again)."""
    taken = re.findall(
        rf"running a \w+ request .*\[request_id={re.escape(batch_id)}-(\d+)(?:~\d+)?\]$",
        worker.log_path.read_text("utf-8", "replace"),
        re.MULTILINE,
    )
    return dict(Counter(f"req-{line}" for line in taken))


def once() -> dict[str, int]:
    """Each line of the job, run once."""
    return {f"req-{i}": 1 for i in range(TOTAL)}


def gateway_on(worker: HeldWorker, tmp_path: Path, name: str, *flags: str) -> Served:
    return start_gateway(tmp_path / f"{name}.log", worker.address, *SHORT_LEASE, *flags)


def done_by(store: Database, batch_id: str, pid: int, only: tuple[int, ...] = ()) -> int:
    """Lines of the job that the gateway process ``pid`` committed (of ``only``, if given)."""
    query = select(func.count()).where(
        lines.c.batch_id == batch_id, lines.c.done_by.like(f"%:{pid}:%")
    )
    if only:
        query = query.where(lines.c.line.in_(only))
    with store.read() as db:
        return int(db.scalar(query) or 0)


def assert_whole(gateway: Served, batch_id: str) -> None:
    """The job completed with one answer per line, in order."""
    client = client_of(gateway)
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (TOTAL, 0)
    output = lines_of(client, batch.output_file_id)
    assert [x["custom_id"] for x in output] == [f"req-{i}" for i in range(TOTAL)]


def test_a_gateway_killed_on_a_held_line_resumes_the_job_from_it(tmp_path: Path) -> None:
    state = ("--state-dir", str(tmp_path / "state"))
    with held_worker(tmp_path / "worker.log", *DEBUG) as worker:
        first = gateway_on(worker, tmp_path, "first", *state, "--batch-max-inflight", "1")
        try:
            batch_id = create(client_of(first), job())
            wait_for_batch(first, batch_id, lambda b: b["request_counts"]["completed"] >= THROUGH)
            wait_until(lambda: running_at(first, worker) == 1, "line 3 held at the worker")
        finally:
            stop_serve(first, signal.SIGKILL)
        store = Database("", tmp_path / "state")
        try:
            assert committed(store, batch_id) == THROUGH
            worker.say("release")
            second = gateway_on(worker, tmp_path, "second", *state, "--batch-max-inflight", "4")
            try:
                # Line 3's lease lapses (SHORT_LEASE) and the second gateway takes it.
                wait_for_batch(second, batch_id, finished, timeout=300)
                assert_whole(second, batch_id)
                # At the worker: line 3 twice (held there at the kill, then the
                # second gateway's), every other line once: the committed lines
                # did not run again.
                assert runs_at(worker, batch_id) == {**once(), "req-3": 2}
                assert done_by(store, batch_id, second.proc.pid, only=(THROUGH,)) == 1
            finally:
                stop_serve(second)
        finally:
            store.close()


@pytest.fixture
def database(postgres_server: PostgresServer) -> str:
    return postgres_server.create_database("faults_replica_killed_mid_batch")


def test_a_replica_killed_holding_two_lines_leaves_both_to_the_other(
    tmp_path: Path, database: str
) -> None:
    def replica(worker: HeldWorker, name: str, inflight: str) -> Served:
        state = ("--state-dir", str(tmp_path / f"{name}-state"), "--state-db", database)
        return gateway_on(worker, tmp_path, name, *state, "--batch-max-inflight", inflight)

    held = (THROUGH, THROUGH + 1)
    with held_worker(tmp_path / "worker.log", *DEBUG) as worker:
        victim = replica(worker, "victim", "2")
        try:
            batch_id = create(client_of(victim), job())
            wait_for_batch(victim, batch_id, lambda b: b["request_counts"]["completed"] >= THROUGH)
            wait_until(lambda: running_at(victim, worker) == 2, "lines 3 and 4 held")
            survivor = replica(worker, "survivor", "4")
        finally:
            stop_serve(victim, signal.SIGKILL)
        store = Database(database, tmp_path)
        try:
            worker.say("release")
            wait_for_batch(survivor, batch_id, finished, timeout=300)
            assert_whole(survivor, batch_id)
            assert done_by(store, batch_id, victim.proc.pid) == THROUGH
            # The victim's two leases lapsed to the survivor, which ran the rest:
            # at the worker, lines 3 and 4 twice (the victim's, held at the
            # kill, and the survivor's), every other line once.
            assert done_by(store, batch_id, survivor.proc.pid, only=held) == 2
            assert runs_at(worker, batch_id) == {**once(), "req-3": 2, "req-4": 2}
        finally:
            store.close()
            stop_serve(survivor)
