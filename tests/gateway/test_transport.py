"""The gateway's ZeroMQ link: no silent sends to a worker that is not there, and
what one loop turn queues leaves as one message, in order."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import pytest
import zmq
import zmq.asyncio

from gateway.dispatch.transport import LinkEvents, WorkerLink
from gateway.dispatch.workers import Worker, Workers
from shared import protocol
from shared.settings import LinkSettings
from tests.conftest import free_port

# A bound on what must happen (a connection, a message): a hang guard, with
# room for a test process that gets a small share of a core.
WITHIN = 30.0


def run(scenario):  # type: ignore[no-untyped-def]
    """Run ``scenario()`` on a fresh loop; fail on any error the loop reports."""
    loop_errors: list[dict] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    result = loop.run_until_complete(scenario())
    gc.collect()  # unretrieved future exceptions are reported on collection
    loop.close()
    assert not loop_errors, loop_errors
    return result


def test_send_without_a_connected_worker_reports_the_link_down_then_succeeds() -> None:
    async def scenario() -> tuple[int, int, list[bytes]]:
        ctx = zmq.asyncio.Context()
        link_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()  # links use plain sockets
        address = f"tcp://127.0.0.1:{free_port()}"
        down: list[WorkerLink] = []
        link = WorkerLink(
            link_ctx,
            address,
            b"gw-test",
            LinkEvents(lambda _link, _message: None, on_disconnect=down.append),
        )
        link.start()
        ping = protocol.Ping(gateway_id="gw-test", sent_at=1.0)
        link.send(ping)  # nobody listens yet: refused at the end of the turn
        await asyncio.sleep(0.01)
        refused = len(down)
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)
        deadline = time.monotonic() + WITHIN
        while True:  # until the DEALER has connected
            before = len(down)
            link.send(ping)
            await asyncio.sleep(0.02)
            if len(down) == before:
                break
            assert time.monotonic() < deadline, "never connected"
        frames = await asyncio.wait_for(router.recv_multipart(), WITHIN)
        router.close(0)
        await link.close()
        link_ctx.term()
        ctx.term()
        return refused, len(down), frames

    refused, _, frames = run(scenario)
    assert refused == 1
    assert frames[0] == b"gw-test"
    assert isinstance(protocol.worker_decoder().decode(frames[1]), protocol.Ping)


def test_messages_queued_in_one_turn_leave_as_one_message_in_order() -> None:
    async def scenario() -> list[bytes]:
        ctx = zmq.asyncio.Context()
        link_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        address = f"tcp://127.0.0.1:{free_port()}"
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)
        connected = asyncio.Event()
        link = WorkerLink(
            link_ctx,
            address,
            b"gw-test",
            LinkEvents(lambda _link, _message: None, on_connect=lambda _link: connected.set()),
        )
        link.start()
        await asyncio.wait_for(connected.wait(), WITHIN)
        for n in range(3):
            link.send(protocol.Abort(request_ids=[f"r{n}"]))
        frames = await asyncio.wait_for(router.recv_multipart(), WITHIN)
        router.close(0)
        await link.close()
        link_ctx.term()
        ctx.term()
        return frames

    frames = run(scenario)
    decode = protocol.worker_decoder().decode
    assert frames[0] == b"gw-test"
    assert [decode(body) for body in frames[1:]] == [
        protocol.Abort(request_ids=[f"r{n}"]) for n in range(3)
    ]


def test_a_link_that_hears_its_own_ping_dials_again(caplog: pytest.LogCaptureFixture) -> None:
    """TCP self-connect (a CI run: the gateway's link held the second worker's
    port, which was in the ephemeral range, and heard its own pings): the link
    hangs up and dials again; anyone else's ping is only dropped."""

    async def scenario() -> WorkerLink:
        link_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        heard: list[object] = []
        link = WorkerLink(
            link_ctx,
            f"tcp://127.0.0.1:{free_port()}",
            b"gw-self",
            LinkEvents(lambda _link, message: heard.append(message)),
        )
        link.start()
        encode = protocol.encoder().encode
        link._on_frame(encode(protocol.Ping(gateway_id="gw-other", sent_at=1.0)))
        assert "connected to itself" not in caplog.text and link.last_received == 0.0
        link._on_frame(encode(protocol.Ping(gateway_id="gw-self", sent_at=1.0)))
        assert caplog.text.count("connected to itself") == 1
        assert link.last_received == 0.0 and not heard
        await link.close()
        link_ctx.term()
        return link

    run(scenario)
    assert "connected to itself" in caplog.text
    assert "dropping an undecodable frame" in caplog.text  # the other gateway's ping


def test_requests_failed_when_the_link_dropped_are_aborted_once_it_connects_again() -> None:
    """The Abort for a dropped link's requests is lost with the link; it goes
    again on reconnecting, so a worker that lived through the drop (a network
    blip) stops running them for nobody."""

    async def scenario() -> list[protocol.ToWorker]:
        ctx = zmq.asyncio.Context()
        address = f"tcp://127.0.0.1:{free_port()}"
        decode = protocol.worker_decoder().decode
        encoder = protocol.encoder()

        async def messages(router: zmq.asyncio.Socket) -> list[protocol.ToWorker]:
            frames = await asyncio.wait_for(router.recv_multipart(), WITHIN)
            return [decode(body) for body in frames[1:]]

        lost: list[str] = []
        up, down = asyncio.Event(), asyncio.Event()

        class Events:
            def worker_output(self, _link: Any, _message: Any) -> None:
                pass

            def worker_lost(
                self, worker: Worker, reason: str, may_return: bool
            ) -> tuple[list[str], int]:
                lost.append(reason)
                down.set()
                return sorted(worker.requests), 0

            def worker_up(self) -> None:
                up.set()

            def worker_draining(self, _worker: Any) -> None:
                pass

        workers = Workers(LinkSettings(), "gw-test", events=Events())
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)
        workers.sync({address})
        state = workers.by_address[address]
        assert isinstance((await messages(router))[0], protocol.Ping)  # hello
        beat = protocol.Heartbeat("w", "one", ["m"], capacity=8)
        router.send_multipart([b"gw-test", encoder.encode(beat)])
        await asyncio.wait_for(up.wait(), WITHIN)
        state.requests.update({"r1", "r2"})
        router.close(0)  # the connection drops; the worker itself lives on
        await asyncio.wait_for(down.wait(), WITHIN)
        assert lost == ["the worker was lost: its connection dropped"]
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)  # the same worker, reachable again: the link redials
        received: list[protocol.ToWorker] = []
        while not any(isinstance(m, protocol.Abort) for m in received):
            received += await messages(router)
        router.close(0)
        await workers.close()
        ctx.term()
        return received

    received = run(scenario)
    assert protocol.Abort(request_ids=["r1", "r2"]) in received, received
    assert isinstance(received[0], protocol.Ping)  # said hello first
