"""The gateway's ZeroMQ link: no silent sends to a worker that is not there."""

from __future__ import annotations

import asyncio
import gc

import pytest
import zmq
import zmq.asyncio

from gateway.transport import WorkerLink
from shared import protocol
from tests.conftest import free_port


def test_send_without_a_connected_worker_fails_and_then_succeeds() -> None:
    async def scenario() -> tuple[bool, bool, protocol.ToWorker]:
        ctx = zmq.asyncio.Context()
        address = f"tcp://127.0.0.1:{free_port()}"
        link = WorkerLink(ctx, address, b"gw-test", lambda _link, _message: None)
        ping = protocol.Ping(gateway_id="gw-test", sent_at=1.0)
        before = link.send(ping)  # nobody listens yet: refused at once
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)
        for _ in range(100):  # until the DEALER has connected
            if link.send(ping):
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("never connected")
        _identity, body = await asyncio.wait_for(router.recv_multipart(), 5)
        router.close(0)
        await link.close()
        ctx.term()
        return before, True, protocol.worker_decoder().decode(body)

    loop_errors: list[dict] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    before, after, received = loop.run_until_complete(scenario())
    gc.collect()  # unretrieved future exceptions are reported on collection
    loop.close()
    assert before is False and after is True
    assert isinstance(received, protocol.Ping)
    assert not loop_errors, loop_errors
