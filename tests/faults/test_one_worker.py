"""Faults with one worker, on the held double: the worker stalls, the gateway stalls.

The requests are held at the worker (tests/faults/held.py) while the test
injects the fault, so each scenario happens as written, the first time: no
request can end before the fault lands, and none ends until the test lets
it. The same faults on the real engine, asserting outcomes only, are in
tests/integration/test_pool.py.
"""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import httpx
import psutil

from tests.faults.held import (
    BODY,
    STAYS,
    TOKENS,
    gateway_over,
    held_worker,
    http_client,
    running_at,
)
from tests.harness.waiting import wait_until
from tests.integration.streams import Stream, read_stream
from tests.integration.test_pool import STARVED, metric


async def started(client: httpx.AsyncClient) -> tuple[asyncio.Future, asyncio.Future]:  # type: ignore[type-arg]
    """A plain request and a stream that cannot move, sent; returns once the
    stream's first chunk came."""
    streaming = asyncio.Event()
    plain = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
    stream = asyncio.ensure_future(
        read_stream(client, {**BODY, **STAYS}, on_first_chunk=lambda _: streaming.set())
    )
    await asyncio.wait_for(streaming.wait(), 60)
    return plain, stream


def test_a_lone_worker_that_stalls_keeps_every_request_and_they_end_whole(
    tmp_path: Path,
) -> None:
    """With one worker, a stall past --heartbeat-timeout (3 s) leaves nowhere
    to retry: its requests, a stream under way and a plain request alike,
    wait for it (--stall-timeout) and end whole once it speaks again."""
    # --gateway-timeout 600: the worker keeps the gateway's requests through
    # any stall of the gateway itself (that fault is the next test's).
    with (
        held_worker(tmp_path / "worker.log", "--gateway-timeout", "600") as worker,
        gateway_over(
            tmp_path / "gateway.log",
            worker,
            flags=("--heartbeat-timeout", "3", "--stall-timeout", "300"),
        ) as gateway,
    ):
        address = worker.address

        async def scenario() -> tuple[httpx.Response, Stream]:
            async with http_client(gateway) as client:
                plain, stream = await started(client)
                await asyncio.to_thread(
                    wait_until, lambda: running_at(gateway, worker) == 2, "both at the worker"
                )
                worker.process.suspend()
                try:
                    await asyncio.to_thread(
                        gateway.wait_for_log, f"worker {address}: 2 requests there wait for it", 60
                    )
                finally:
                    worker.process.resume()
                await asyncio.to_thread(gateway.wait_for_log, f"worker {address} speaks again", 60)
                worker.say("release")
                return await plain, await stream

        plain, stream = asyncio.run(scenario())
        log = gateway.log_path.read_text(errors="replace")
        assert re.search(rf"worker {re.escape(address)} lost: silent for", log), log
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["completion_tokens"] == TOKENS
        assert stream.whole(TOKENS), stream
        assert "retrying" not in log, log
        resumed = metric(
            gateway.base_url, "llmgate_worker_stalls_total", worker=address, outcome="resumed"
        )
        assert resumed == 1


def test_a_gateway_paused_past_the_gateway_timeout_gets_its_requests_ended_not_hung(
    tmp_path: Path,
) -> None:
    """The worker gives up on a gateway it has not heard from for
    --gateway-timeout (5 s here) and drops its requests; the gateway, once it
    runs again, must learn of it (a 503 each), not wait for output that never
    comes: the stream under way, which cannot move (structured output),
    ends with an error event naming the cause, and the plain request goes on
    from its first tokens on the same worker (it was the gateway that
    stalled, not the worker) and ends whole."""
    with (
        held_worker(tmp_path / "worker.log", "--gateway-timeout", "5") as worker,
        gateway_over(tmp_path / "gateway.log", worker, flags=()) as gateway,
    ):
        gateway_id = re.search(r"gateway id (gw-\w+)", gateway.log_path.read_text()).group(1)  # type: ignore[union-attr]
        paused = gateway.proc.pid

        async def scenario() -> tuple[httpx.Response, Stream]:
            async with http_client(gateway) as client:
                plain, stream = await started(client)
                await asyncio.to_thread(
                    wait_until, lambda: running_at(gateway, worker) == 2, "both at the worker"
                )
                gateway_process = psutil.Process(paused)
                gateway_process.suspend()
                try:
                    await asyncio.to_thread(
                        worker.wait_for_log, f"gateway b'{gateway_id}' silent for 5s: aborting"
                    )
                finally:
                    gateway_process.resume()
                ended = await asyncio.wait_for(stream, 60)
                # The plain request goes on, on the only worker there is,
                # and waits at its gate like the first time...
                await asyncio.to_thread(
                    gateway.wait_for_log,
                    f"moving the answer on from {worker.address} (gateway_silent)",
                )
                await asyncio.to_thread(
                    wait_until, lambda: running_at(gateway, worker) == 1, "the retry at the worker"
                )
                assert not plain.done()
                # ...until the test lets it go.
                worker.say("release")
                return await plain, ended

        plain, stream = asyncio.run(scenario())
        assert stream.tokens and stream.done, stream
        assert stream.error is not None and "--gateway-timeout" in stream.error, stream
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["completion_tokens"] == TOKENS
        log = gateway.log_path.read_text(errors="replace")
        assert "stream ended by its worker: 503" in log, log
        assert metric(gateway.base_url, "llmgate_migrations_total", reason="gateway_silent") == 1
        # It says why: it was the one stalled, not its worker, and not by its own work.
        assert STARVED.search(gateway.wait_for_log("this gateway's event loop woke", 10)), log


def test_a_lone_draining_worker_keeps_its_stream_when_there_is_nowhere_to_move(
    tmp_path: Path,
) -> None:
    """SIGTERM with no other worker: the gateway does not hand the stream over
    (a move would find no worker and end it with an error event); the drain
    waits for it, and it ends whole there before the worker exits."""
    with (
        held_worker(tmp_path / "worker.log", "--gateway-timeout", "600") as worker,
        gateway_over(tmp_path / "gateway.log", worker, flags=()) as gateway,
    ):

        async def scenario() -> Stream:
            async with http_client(gateway) as client:
                streaming = asyncio.Event()
                stream = asyncio.ensure_future(
                    read_stream(client, BODY, on_first_chunk=lambda _: streaming.set())
                )
                await asyncio.wait_for(streaming.wait(), 60)
                worker.proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(
                    gateway.wait_for_log, f"worker {worker.address} is draining", 60
                )
                worker.say("release")
                return await stream

        stream = asyncio.run(scenario())
        assert worker.proc.wait(timeout=60) == 0
        log = gateway.log_path.read_text(errors="replace")
    assert stream.whole(TOKENS), stream
    assert "requests move on" not in log and "moving the answer on" not in log, log
