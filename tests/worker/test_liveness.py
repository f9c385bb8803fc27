"""worker.liveness: a gateway that went silent or disconnected loses its requests,
around the FAKE engine (a double: no model)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq

from loadtest.fake_engine import FakeEngine
from shared import protocol
from shared.settings import WorkerSettings
from tests.conftest import free_port
from tests.harness.waiting import until
from tests.worker.test_server import GATEWAY, MODEL, frames, generate, settle
from worker.server import WorkerServer


async def test_a_silent_gateways_requests_are_aborted_and_each_answered_503() -> None:
    """A gateway that was only starved, not gone, must learn its requests
    ended: without the 503 it would wait for their output forever."""
    settings = WorkerSettings.of(heartbeat_interval=0.05, gateway_timeout=0.5)
    server = WorkerServer(settings, FakeEngine([MODEL], token_interval=0.01))
    sent: list[tuple[bytes, protocol._Message]] = []
    server.send = lambda identity, message: sent.append((identity, message))  # type: ignore[method-assign]
    beats = asyncio.create_task(server.liveness.heartbeats())
    try:
        server._on_frames(frames(generate("r1", 100_000), generate("r2", 100_000)))
        # No more pings from GATEWAY: past the timeout, the loop forgets it.
        await asyncio.wait_for(settle(server), timeout=30)
    finally:
        beats.cancel()
        server.raw.close(0)
        server.sock.close(0)
        server.ctx.term()
    assert GATEWAY not in server.gateways
    failed = {m.request_id: m for identity, m in sent if isinstance(m, protocol.Failed)}
    assert sorted(failed) == ["r1", "r2"]
    assert all(identity == GATEWAY for identity, m in sent if isinstance(m, protocol.Failed))
    assert all(m.status == 503 and "--gateway-timeout" in m.message for m in failed.values())
    # Named as such: the gateway may send them to this worker again.
    assert all(m.cause == protocol.GATEWAY_SILENT for m in failed.values())


async def test_a_disconnected_gateways_requests_are_aborted_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A gateway that exits closes its connection: its requests end then, not
    after --gateway-timeout (here 10 minutes) of silence; another gateway's
    requests run on."""
    address = f"tcp://127.0.0.1:{free_port()}"
    settings = WorkerSettings.of(bind=address, gateway_timeout=600)
    server = WorkerServer(settings, FakeEngine([MODEL], token_interval=0.01))
    serving = asyncio.create_task(server.serve())
    ctx = zmq.Context()
    gateways = {}
    try:
        for name in (b"gw-leaves", b"gw-stays"):
            sock = gateways[name] = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, name)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            sock.send(protocol.encoder().encode(generate("r1", 100_000)))
        await until(lambda: len(server.requests) == 2)
        # Its heartbeats tell each gateway how many it serves (gateway's kv policy).
        assert server.liveness.heartbeat().gateways == 2
        with caplog.at_level(logging.WARNING, logger="worker.liveness"):
            gateways.pop(b"gw-leaves").close(0)
            await until(lambda: (b"gw-leaves", "r1") not in server.requests)
        assert list(server.requests) == [(b"gw-stays", "r1")]
        assert list(server.gateways) == [b"gw-stays"]
        assert server.liveness.heartbeat().gateways == 1
        assert "gateway b'gw-leaves' disconnected: aborting 1 requests" in caplog.text
    finally:
        for sock in gateways.values():
            sock.close(0)
        server._stop.set()
        await asyncio.wait_for(serving, timeout=30)
        ctx.term()
