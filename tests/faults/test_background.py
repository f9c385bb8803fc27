"""Background responses over two replicas sharing a real PostgreSQL, on the held double.

The double holds each answer after its first ``HOLD_AFTER`` tokens, so the
response is still under way when the fault lands (a replica killed, a
client gone, a cancel) whatever the machine's speed. Each test reads the
stream as a client does, through the other replica, and checks it whole:
every event once, numbered 0, 1, 2, ... with no gap, one output item id,
the text of every token. The same flows on the real engine, asserting the
text: tests/integration/test_responses_state.py.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from gateway.state.db import Database
from gateway.state.tables import background, response_events
from loadtest.fake_engine import TOKEN_TEXT
from tests.conftest import MODEL, Served, start_gateway, stop_serve
from tests.faults.held import HOLD_AFTER, HeldWorker, gateway_over, held_worker, running_at
from tests.harness.postgres_server import PostgresServer
from tests.harness.waiting import wait_until
from tests.integration.streams import events_with_ids, piece_of

TOKENS = 8
# Events stored before the gate: created, in progress, item and part added,
# and a delta per token sent.
BEFORE_GATE = 4 + HOLD_AFTER
ASK = {"model": MODEL, "input": "Once upon a time", "max_output_tokens": TOKENS}
# A lapsed lease is taken over within this plus a look (1 s).
LEASE = ("--background-lease-seconds", "3")


_databases = itertools.count()


@pytest.fixture
def database(postgres_server: PostgresServer) -> Iterator[str]:
    yield postgres_server.create_database(f"faults_background_{next(_databases)}")


def replica(worker: HeldWorker, tmp_path: Path, name: str, database: str) -> Served:
    state = ("--state-dir", str(tmp_path / f"{name}-state"), "--state-db", database)
    return start_gateway(tmp_path / f"{name}.log", worker.address, *state, *LEASE)


def stored_events(store: Database, response_id: str) -> int:
    query = select(func.count()).where(response_events.c.response_id == response_id)
    with store.read() as db:
        return int(db.scalar(query) or 0)


def runner_pid(store: Database, response_id: str) -> int:
    """The pid of the gateway process that holds the response's lease."""
    with store.read() as db:
        owner = db.scalar(select(background.c.lease_owner).where(background.c.id == response_id))
    assert owner, "nobody runs it"
    return int(owner.split(":")[-2])


def events_of(gateway: Served, response_id: str, after: int = -1, most: int = 0) -> list[Any]:
    """The events a client reads from ``gateway`` after ``after`` (at most ``most``,
    then it leaves), as JSON."""
    url = f"{gateway.base_url}/v1/responses/{response_id}"
    params: dict[str, str | int] = {"stream": "true"}
    if after >= 0:
        params["starting_after"] = after
    read: list[Any] = []
    with httpx.stream("GET", url, params=params, timeout=300) as stream:
        assert stream.status_code == 200, stream.read()
        for line in stream.iter_lines():
            if line.startswith("data: "):
                read.append(json.loads(line[6:]))
                if most and len(read) == most:
                    break
    return read


def assert_whole(events: list[Any], first: int = 0) -> None:
    """Each event once, numbered on from ``first``; one item; every token; completed."""
    assert [e["sequence_number"] for e in events] == list(range(first, first + len(events)))
    assert events[-1]["type"] == "response.completed"
    ids = {e["item_id"] for e in events if "item_id" in e}
    ids |= {e["item"]["id"] for e in events if "item" in e}
    ids |= {item["id"] for item in events[-1]["response"]["output"]}
    assert len(ids) == 1, ids


def text_of(events: list[Any]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def create(gateway: Served, **extra: Any) -> str:
    made = httpx.post(
        f"{gateway.base_url}/v1/responses", json={**ASK, "background": True, **extra}, timeout=60
    )
    assert made.status_code == 200, made.text
    assert made.json()["status"] == "queued"
    return str(made.json()["id"])


def runs_at(worker: HeldWorker, response_id: str) -> int:
    """How many times the worker took the response's request."""
    found = re.findall(
        rf"running a vllm request .*\[request_id={re.escape(response_id)}(?:~\d+)?\]$",
        worker.log_path.read_text("utf-8", "replace"),
        re.MULTILINE,
    )
    return len(found)


@dataclass
class Held:
    """A background response made through one of two replicas, held at the
    worker's gate: which replica runs it, which does not."""

    worker: HeldWorker
    store: Database
    response_id: str
    runner: Served
    other: Served


@contextmanager
def held_response(tmp_path: Path, database: str, *flags: str) -> Iterator[Held]:
    with held_worker(tmp_path / "worker.log", *flags) as worker:
        gateways = [replica(worker, tmp_path, name, database) for name in ("a", "b")]
        store = Database(database, tmp_path)
        try:
            response_id = create(gateways[0])
            wait_until(
                lambda: stored_events(store, response_id) == BEFORE_GATE, "held after its tokens"
            )
            pid = runner_pid(store, response_id)
            [runner] = [g for g in gateways if g.proc.pid == pid]
            [other] = [g for g in gateways if g is not runner]
            yield Held(worker, store, response_id, runner, other)
        finally:
            store.close()
            for gateway in gateways:
                stop_serve(gateway)


def test_a_replica_killed_mid_answer_leaves_it_to_the_other_which_finishes_it(
    tmp_path: Path, database: str
) -> None:
    with held_response(tmp_path, database, "--log-level", "debug") as held:
        survivor, response_id = held.other, held.response_id
        # A client follows it through the survivor from before the kill.
        read = events_of(survivor, response_id, most=BEFORE_GATE)
        stop_serve(held.runner, signal.SIGKILL)
        held.worker.say("release")
        read += events_of(survivor, response_id, after=BEFORE_GATE - 1)
        assert_whole(read)
        assert text_of(read) == TOKEN_TEXT * TOKENS
        # Run twice at the worker: the victim's run, and the survivor's,
        # which repeated the events sent and went on after them.
        assert runs_at(held.worker, response_id) == 2
        assert runner_pid_after(held.store, response_id) is None
        found = httpx.get(f"{survivor.base_url}/v1/responses/{response_id}").json()
        assert found["status"] == "completed"
        assert found["output"][0]["content"][0]["text"] == TOKEN_TEXT * TOKENS


def runner_pid_after(store: Database, response_id: str) -> str | None:
    """Who holds it now (nobody, once it ended)."""
    with store.read() as db:
        owner: str | None = db.scalar(
            select(background.c.lease_owner).where(background.c.id == response_id)
        )
        return owner


def test_a_client_that_left_resumes_through_the_other_replica_with_every_event_once(
    tmp_path: Path, database: str
) -> None:
    with held_worker(tmp_path / "worker.log") as worker:
        gateways = [replica(worker, tmp_path, name, database) for name in ("a", "b")]
        try:
            made = httpx.stream(
                "POST",
                f"{gateways[0].base_url}/v1/responses",
                json={**ASK, "background": True, "stream": True},
                timeout=60,
            )
            first: list[Any] = []
            with made as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        first.append(json.loads(line[6:]))
                        if len(first) == BEFORE_GATE:
                            break  # the client leaves, the answer held
            response_id = first[0]["response"]["id"]
            worker.say("release")
            rest = events_of(gateways[1], response_id, after=first[-1]["sequence_number"])
            assert_whole(first + rest)
            assert text_of(first + rest) == TOKEN_TEXT * TOKENS
        finally:
            for gateway in gateways:
                stop_serve(gateway)


def test_a_cancel_through_the_other_replica_stops_it_at_the_worker(
    tmp_path: Path, database: str
) -> None:
    with held_response(tmp_path, database) as held:
        response_id, runner, other = held.response_id, held.runner, held.other
        cancelled = httpx.post(f"{other.base_url}/v1/responses/{response_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        # The runner sees it at its next lease renewal and aborts the request.
        wait_until(lambda: running_at(runner, held.worker) == 0, "the request aborted")
        read = events_of(other, response_id)
        assert len(read) == BEFORE_GATE and read[-1]["type"] != "response.completed"
        held.worker.say("release")
        again = httpx.post(f"{runner.base_url}/v1/responses/{response_id}/cancel").json()
        assert again["status"] == "cancelled"


def test_a_worker_killed_mid_answer_leaves_it_to_another_worker(tmp_path: Path) -> None:
    """Its run breaks (vLLM's routes do not move mid-answer); the runner runs it
    again on the other worker, which repeats the events sent and goes on."""
    state = ("--state-dir", str(tmp_path / "state"))
    flags = ("--policy", "round-robin", "--heartbeat-timeout", "3", *state)
    with (
        held_worker(tmp_path / "one.log", "--log-level", "debug", name="one") as one,
        held_worker(tmp_path / "two.log", "--log-level", "debug", name="two") as two,
        gateway_over(tmp_path / "gateway.log", one, two, flags=flags) as gateway,
    ):
        store = Database("", tmp_path / "state")
        try:
            response_id = create(gateway)
            wait_until(
                lambda: stored_events(store, response_id) == BEFORE_GATE, "held after its tokens"
            )
            # Where it runs, as the workers' heartbeats tell.
            wait_until(
                lambda: running_at(gateway, one) + running_at(gateway, two) == 1, "its worker"
            )
            [victim] = [w for w in (one, two) if running_at(gateway, w) == 1]
            [other] = [w for w in (one, two) if w is not victim]
            victim.proc.kill()
            wait_until(lambda: runs_at(other, response_id) == 1, "run again on the other")
            other.say("release")
            read = events_of(gateway, response_id)
            assert_whole(read)
            assert text_of(read) == TOKEN_TEXT * TOKENS
            assert "its stream broke" in gateway.log_path.read_text("utf-8", "replace")
        finally:
            store.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_resumable_stream_resumes_with_last_event_id_after_its_replica_died(
    tmp_path: Path, database: str, path: str
) -> None:
    """``x-llmgate-resumable``: the client reads each chunk with an SSE id and
    drops; the replica running it is killed; the same request sent with
    ``Last-Event-ID`` through the other replica gets every later chunk once
    (the survivor took the stream over), then ``[DONE]``."""
    chat = {"messages": [{"role": "user", "content": "Once upon a time"}]}
    request = {"model": MODEL, "max_tokens": TOKENS, "stream": True}
    request.update(chat if path == "/v1/chat/completions" else {"prompt": "Once upon a time"})
    with held_worker(tmp_path / "worker.log") as worker:
        gateways = [replica(worker, tmp_path, name, database) for name in ("a", "b")]
        store = Database(database, tmp_path)
        try:
            opt_in = {"x-llmgate-resumable": "true"}
            url = f"{gateways[0].base_url}{path}"
            read = events_with_ids(url, request, opt_in, until_pieces=HOLD_AFTER)
            stream_id = read[-1][0].split(":")[0]
            [runner] = [g for g in gateways if g.proc.pid == runner_pid(store, stream_id)]
            [survivor] = [g for g in gateways if g is not runner]
            stop_serve(runner, signal.SIGKILL)
            worker.say("release")
            resumed = {"last-event-id": read[-1][0]}
            read += events_with_ids(f"{survivor.base_url}{path}", {"model": MODEL}, resumed)
            assert [int(i.split(":")[1]) for i, _ in read if i] == list(range(len(read) - 1))
            assert read[-1] == ("", "[DONE]")
            chunks = [json.loads(data) for _, data in read[:-1]]
            assert "".join(piece_of(c) for c in chunks) == TOKEN_TEXT * TOKENS
            # One stream: one chunk id and one ``created``, the first run's.
            assert len({(c["id"], c["created"]) for c in chunks}) == 1, chunks
            gone = httpx.post(
                f"{survivor.base_url}{path}",
                json={"model": MODEL},
                headers={"last-event-id": "unknown:3"},
            )
            assert gone.status_code == 404, gone.text
        finally:
            store.close()
            for gateway in gateways:
                stop_serve(gateway)
