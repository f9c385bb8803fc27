"""Streams move on when their worker dies or stops mid-answer, on the held double.

Two held workers behind a round-robin gateway: streams sent one after
another land half on each, and each holds after its first tokens (the
double's gate), so the victim holds streams under way when the fault lands.
The victim is killed (its connection drops), stopped (its heartbeats
lapse) or drained (SIGTERM: the gateway hands its streams over); its
streams go on on the other worker from the tokens they had sent, and once
that one is let go every stream ends whole: one id, every token once, no
error event, its usage counting both parts. What the real engine makes of
the tokens it is handed: tests/integration/test_two_workers.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.fake_engine import TOKEN_TEXT
from tests.faults.held import BODY, TOKENS, HeldWorker, http_client, running_at
from tests.faults.test_two_workers import two_held
from tests.harness.waiting import wait_until
from tests.integration.streams import PlainStream, read_plain
from tests.integration.test_pool import metric

# Streams sent; half land on the victim.
STREAMS = 4


def whole(stream: PlainStream) -> bool:
    """Ended normally, one id, every token once, its usage counting them all."""
    return (
        stream.error is None
        and stream.done
        and len(stream.ids) == 1
        and stream.text == TOKEN_TEXT * TOKENS
        and stream.usage is not None
        and stream.usage["completion_tokens"] == TOKENS
    )


async def start_streams(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> list[asyncio.Future[PlainStream]]:
    """``STREAMS`` streams, each under way before the next is sent."""
    streams = []
    for _ in range(STREAMS):
        first = asyncio.Event()
        reading = read_plain(client, "/v1/completions", body, first.set)
        streams.append(asyncio.ensure_future(reading))
        await asyncio.wait_for(first.wait(), 60)
    return streams


def run_fault(
    tmp_path: Path, fault: str, body: dict[str, Any] = BODY
) -> tuple[list[PlainStream], HeldWorker, str]:
    with two_held(tmp_path, stall_timeout="300") as (victim, other, gateway):

        async def scenario() -> list[PlainStream]:
            async with http_client(gateway) as client:
                streams = await start_streams(client, body)
                if fault == "kill":
                    victim.proc.kill()
                elif fault == "drain":
                    victim.proc.send_signal(signal.SIGTERM)
                else:
                    victim.process.suspend()
                try:
                    await asyncio.to_thread(
                        wait_until,
                        lambda: (
                            metric(gateway.base_url, "llmgate_migrations_total") == STREAMS // 2
                        ),
                        f"{STREAMS // 2} streams moved",
                    )
                finally:
                    if fault == "stop":
                        victim.process.resume()
                if fault == "drain":
                    # Its drain waited for nothing: the moved streams are
                    # still held on the other worker.
                    assert await asyncio.to_thread(victim.proc.wait, 60) == 0
                other.say("release")
                return list(await asyncio.gather(*streams))

        streams = asyncio.run(scenario())
        return streams, victim, gateway.log_path.read_text(errors="replace")


def test_a_killed_worker_s_streams_move_on_whole(tmp_path: Path) -> None:
    streams, victim, log = run_fault(tmp_path, "kill")
    assert all(whole(s) for s in streams), streams
    # Half started on the victim (the header says where a stream began).
    assert sum(s.worker == victim.address for s in streams) == STREAMS // 2, streams
    assert log.count("moving the answer on from") == STREAMS // 2, log
    assert "stream cut" not in log, log


def test_streams_with_logprobs_move_on_with_an_entry_per_token(tmp_path: Path) -> None:
    """The next worker scores the tokens it makes; those before went out scored."""
    streams, _, log = run_fault(tmp_path, "kill", {**BODY, "logprobs": 1})
    assert all(whole(s) for s in streams), streams
    assert all(s.scored == [TOKEN_TEXT] * TOKENS for s in streams), streams
    assert log.count("moving the answer on from") == STREAMS // 2, log


def test_a_stopped_worker_s_streams_move_on_once_its_heartbeats_lapse(tmp_path: Path) -> None:
    """SIGSTOP: past --heartbeat-timeout (3 s) its streams move, rather than
    wait out --stall-timeout (300 s here) as a stream that cannot move does."""
    streams, victim, log = run_fault(tmp_path, "stop")
    assert all(whole(s) for s in streams), streams
    assert sum(s.worker == victim.address for s in streams) == STREAMS // 2, streams
    assert "stream cut" not in log, log


def test_a_draining_worker_hands_its_streams_over_and_exits(tmp_path: Path) -> None:
    """SIGTERM: the gateway moves the streams on as soon as the heartbeat says
    it drains, and aborts them there, so its drain ends without them: it
    exits while they are still held on the other worker (not released until
    the victim is gone), not after --drain-timeout (30 s) or their end."""
    streams, victim, log = run_fault(tmp_path, "drain")
    assert all(whole(s) for s in streams), streams
    assert sum(s.worker == victim.address for s in streams) == STREAMS // 2, streams
    assert f"worker {victim.address} drains: {STREAMS // 2} requests move on" in log, log
    assert log.count("(worker_draining) after") == STREAMS // 2, log
    assert "stream cut" not in log, log


@pytest.mark.parametrize("fault", ["kill", "drain"])
def test_whole_requests_go_on_from_their_tokens_too(tmp_path: Path, fault: str) -> None:
    """Non-streamed requests: the one held on the victim goes on on the other
    worker from the tokens it had (not from scratch), and its answer is
    whole: every token once, its usage counting both parts."""
    with two_held(tmp_path, stall_timeout="300") as (victim, other, gateway):

        async def scenario() -> list[httpx.Response]:
            async with http_client(gateway) as client:
                sent = []
                for held in (1, 2):  # round-robin: one on each worker
                    sent.append(asyncio.ensure_future(client.post("/v1/completions", json=BODY)))
                    await asyncio.to_thread(
                        wait_until,
                        lambda held=held: (
                            running_at(gateway, victim) + running_at(gateway, other) == held
                        ),
                        f"{held} requests held",
                    )
                if fault == "kill":
                    victim.proc.kill()
                else:
                    victim.proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(
                    wait_until,
                    lambda: metric(gateway.base_url, "llmgate_migrations_total") == 1,
                    "the victim's request moved",
                )
                other.say("release")
                return list(await asyncio.gather(*sent))

        responses = asyncio.run(scenario())
        log = gateway.log_path.read_text(errors="replace")
    for response in responses:
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == TOKEN_TEXT * TOKENS, body
        assert body["usage"]["completion_tokens"] == TOKENS, body
        assert response.headers["x-llmgate-worker"] == other.address
    assert log.count(f"moving the answer on from {victim.address}") == 1, log
    assert "retrying" not in log, log


async def read_tgi(
    client: httpx.AsyncClient, started: asyncio.Event
) -> tuple[list[dict[str, Any]], str]:
    """A TGI ``/generate_stream``: its token events, and its error if one came."""
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": TOKENS}}
    events: list[dict[str, Any]] = []
    async with client.stream("POST", "/generate_stream", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                return events, str(event["error"])
            events.append(event)
            started.set()
    return events, ""


def test_tgi_streams_move_on_whole_too(tmp_path: Path) -> None:
    """TGI's token events carry each token's logprob: they move like any
    stream with logprobs, each token once, the last event's text whole."""
    with two_held(tmp_path, stall_timeout="300") as (victim, other, gateway):

        async def scenario() -> list[tuple[list[dict[str, Any]], str]]:
            async with http_client(gateway) as client:
                streams = []
                for _ in range(STREAMS):
                    first = asyncio.Event()
                    streams.append(asyncio.ensure_future(read_tgi(client, first)))
                    await asyncio.wait_for(first.wait(), 60)
                victim.proc.kill()
                await asyncio.to_thread(
                    wait_until,
                    lambda: metric(gateway.base_url, "llmgate_migrations_total") == STREAMS // 2,
                    f"{STREAMS // 2} streams moved",
                )
                other.say("release")
                return list(await asyncio.gather(*streams))

        outcomes = asyncio.run(scenario())
    for events, error in outcomes:
        assert not error, (error, events)
        assert [e["index"] for e in events] == list(range(1, TOKENS + 1)), events
        assert [e["token"]["text"] for e in events] == [TOKEN_TEXT] * TOKENS
        assert events[-1]["generated_text"] == TOKEN_TEXT * TOKENS
