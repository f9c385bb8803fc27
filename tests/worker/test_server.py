"""worker.server: the table of running requests, around the FAKE engine (a double: no model).

What is checked here is the worker loop's own bookkeeping, which no engine
changes: a request that ends, however it ends, leaves the table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from loadtest.fake_engine import FakeEngine
from shared import protocol
from shared.settings import WorkerSettings
from worker.server import WorkerServer

MODEL = "fake-model"
GATEWAY = b"gw-test"


def frames(*messages: protocol._Message) -> list[bytes]:
    encoder = protocol.encoder()
    return [GATEWAY, *(encoder.encode(m) for m in messages)]


def generate(request_id: str, max_tokens: int) -> protocol.Generate:
    return protocol.Generate(
        request_id=request_id,
        model=MODEL,
        kind="completion",
        params={"model": MODEL, "prompt": "hi", "max_tokens": max_tokens},
    )


@pytest.fixture
def server() -> Iterator[WorkerServer]:
    engine = FakeEngine([MODEL], token_interval=0.01)
    server = WorkerServer(WorkerSettings(), engine)
    yield server
    # Never bound or served: close what __init__ opened, or the context's
    # term at exit waits on the socket forever.
    server.raw.close(0)
    server.sock.close(0)
    server.ctx.term()


async def settle(server: WorkerServer) -> None:
    """Until every request task has ended and its done callbacks have run."""
    while server.requests:
        await asyncio.wait(list(server.requests.values()))
        await asyncio.sleep(0)


async def test_an_abort_read_with_its_request_leaves_no_entry(server: WorkerServer) -> None:
    # Both in one message: the task is cancelled before its first step, so
    # its body (and any `finally` in it) never runs.
    server._on_frames(frames(generate("r1", 1000), protocol.Abort(request_ids=["r1"])))
    assert list(server.requests) == [(GATEWAY, "r1")]
    await asyncio.wait_for(settle(server), timeout=30)
    assert server.requests == {}


async def test_a_finished_and_an_aborted_request_both_leave(server: WorkerServer) -> None:
    server._on_frames(frames(generate("short", 2), generate("long", 100_000)))
    task = server.requests[(GATEWAY, "short")]
    await asyncio.wait_for(asyncio.wait([task]), timeout=30)
    await asyncio.sleep(0)
    assert list(server.requests) == [(GATEWAY, "long")]
    server._on_frames(frames(protocol.Abort(request_ids=["long"])))
    await asyncio.wait_for(settle(server), timeout=30)
    assert server.requests == {}
