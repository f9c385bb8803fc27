"""The worker's socket on loopback, without an engine: CURVE, ZAP and message limits.

The worker side is the real factory (:func:`worker.server.make_router`),
authenticator (``worker.curve``) and connection monitor (``worker.liveness``);
the gateway side is the real :class:`gateway.dispatch.transport.WorkerLink`.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from gateway.dispatch import transport
from gateway.dispatch.transport import LinkEvents, WorkerLink
from shared import curve_keys, protocol
from shared.settings import LinkSettings, WorkerLinkSettings
from tests.conftest import free_port
from tests.harness.waiting import until
from worker.curve import start_authenticator
from worker.liveness import watch_connections
from worker.server import make_router

# The fixtures' sockets live on the session's loop: so must the tests.
pytestmark = pytest.mark.asyncio(loop_scope="session")

# Long enough for several reconnects (100 ms, doubling) to have been refused.
NOTHING_FOR = 1.5
# A bound on what must come (a message, a log line): a hang guard, with room
# for a test process that gets a small share of a core.
ARRIVES_WITHIN = 30.0


Said = list[tuple[str, str]]  # (logger, message) of each record


async def logged(caplog: pytest.LogCaptureFixture, found: Callable[[Said], bool]) -> Said:
    """What was logged, once ``found`` holds for it (within ARRIVES_WITHIN)."""

    def said() -> Said:
        return [(r.name, r.getMessage()) for r in caplog.records]

    await until(lambda: found(said()), ARRIVES_WITHIN)
    return said()


@dataclass
class Keys:
    worker: curve_keys.CurveServer
    gateway: curve_keys.CurveClient
    dir: Path


@pytest.fixture
def keypairs(tmp_path: Path) -> Keys:
    worker_public, worker_secret = curve_keys.generate(tmp_path / "worker", "worker")
    gateway_public, gateway_secret = curve_keys.generate(tmp_path / "gateway", "gateway")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(gateway_public, authorized)
    server = curve_keys.worker_curve(
        WorkerLinkSettings(
            curve_worker_key_file=str(worker_secret), curve_gateway_keys_dir=str(authorized)
        )
    )
    client = curve_keys.gateway_curve(
        LinkSettings(
            curve_gateway_key_file=str(gateway_secret),
            curve_worker_public_key_file=str(worker_public),
        )
    )
    assert server is not None and client is not None
    return Keys(server, client, tmp_path)


def stranger(tmp_path: Path, name: str) -> tuple[bytes, bytes]:
    """A key pair nobody has authorized."""
    return curve_keys.load_keypair(curve_keys.generate(tmp_path / "strangers", name)[1])


@dataclass
class Worker:
    """The worker's ROUTER, bound as the worker binds it, and its handshake log."""

    ctx: zmq.asyncio.Context
    router: zmq.asyncio.Socket
    address: str
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def receive(self, seconds: float) -> list[bytes] | None:
        if await self.router.poll(seconds * 1000) == 0:
            return None
        return list(await self.router.recv_multipart())


@pytest.fixture
async def worker(request: pytest.FixtureRequest, keypairs: Keys) -> AsyncIterator[Worker]:
    """A CURVE worker socket; ``@pytest.mark.parametrize("worker", [None], indirect=True)``
    for a plaintext one."""
    curve = getattr(request, "param", keypairs.worker)
    ctx = zmq.asyncio.Context()
    authenticator = start_authenticator(ctx, curve) if curve else None
    router = make_router(ctx, curve)
    monitor = router.get_monitor_socket(curve_keys.HANDSHAKE_FAILED)
    address = f"tcp://127.0.0.1:{free_port()}"
    router.bind(address)
    running = Worker(ctx, router, address)
    running.tasks.append(asyncio.create_task(watch_connections(monitor)))
    yield running
    for task in running.tasks:
        task.cancel()
    await asyncio.gather(*running.tasks, return_exceptions=True)
    if authenticator is not None:
        authenticator.stop()
    router.disable_monitor()
    monitor.close(0)
    router.close(0)
    ctx.term()


@dataclass
class Gateway:
    link: WorkerLink
    received: list[protocol.ToGateway] = field(default_factory=list)
    connected: asyncio.Event = field(default_factory=asyncio.Event)


Connect = Callable[[str, "curve_keys.CurveClient | None"], Gateway]


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """Opens gateway links that say hello on their handshake, as the pool's do;
    closes them all afterwards, even when a test fails."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    opened: list[WorkerLink] = []

    def open_link(address: str, curve: curve_keys.CurveClient | None) -> Gateway:
        ping = protocol.Ping(gateway_id="gw-test", sent_at=1.0)
        gateway: Gateway

        def on_connect(link: WorkerLink) -> None:
            gateway.connected.set()
            link.send(ping)

        link = WorkerLink(
            ctx,
            address,
            b"gw-test",
            LinkEvents(
                lambda _link, message: gateway.received.append(message),
                on_disconnect=lambda _link: None,
                on_connect=on_connect,
            ),
            curve=curve,
        )
        gateway = Gateway(link)
        opened.append(link)
        link.start()
        return gateway

    yield open_link
    for link in opened:
        await link.close()
    ctx.term()


async def test_a_gateway_with_the_right_keys_talks_to_the_worker(
    worker: Worker, connect: Connect, keypairs: Keys
) -> None:
    gateway = connect(worker.address, keypairs.gateway)
    frames = await worker.receive(seconds=ARRIVES_WITHIN)
    assert frames is not None, "the worker heard nothing"
    identity, body = frames
    assert identity == b"gw-test"
    assert isinstance(protocol.worker_decoder().decode(body), protocol.Ping)
    beat = protocol.Heartbeat(worker_id="w", incarnation="i", models=["m"])
    await worker.router.send_multipart([identity, protocol.encoder().encode(beat)])
    await until(lambda: gateway.received, ARRIVES_WITHIN)
    assert gateway.received == [beat]


async def test_an_unknown_client_key_gets_nothing_and_the_worker_logs_it(
    worker: Worker,
    connect: Connect,
    keypairs: Keys,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    public, secret = stranger(tmp_path, "intruder")
    intruder = curve_keys.CurveClient(public, secret, keypairs.worker.public_key)
    gateway = connect(worker.address, intruder)
    assert await worker.receive(seconds=NOTHING_FOR) is None
    assert not gateway.connected.is_set()
    assert not gateway.link.send(protocol.Ping(gateway_id="gw-test", sent_at=1.0))
    said = await logged(
        caplog,
        lambda said: (
            any("ZAP denied" in m for _, m in said)
            and any(
                n == "gateway.dispatch.transport" and "refused this gateway's CURVE key" in m
                for n, m in said
            )
        ),
    )
    denials = [m for _, m in said if "ZAP denied" in m]
    assert len(denials) == 1, "once, not on every reconnect"
    assert public.decode() in denials[0]


async def test_a_plaintext_client_gets_nothing(
    worker: Worker, connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = connect(worker.address, None)
    assert await worker.receive(seconds=NOTHING_FOR) is None
    assert not gateway.connected.is_set()

    # Logged once on each side, not on every reconnect; in words that depend on
    # which side noticed the mismatch first.
    def worker_said(said: Said) -> list[str]:
        return [m for n, m in said if n == "worker.liveness" and "a client failed the" in m]

    def gateway_said(said: Said) -> list[str]:
        return [m for n, m in said if n == "gateway.dispatch.transport" and "handshake with" in m]

    said = await logged(caplog, lambda said: bool(worker_said(said) and gateway_said(said)))
    assert len(worker_said(said)) == 1
    assert len(gateway_said(said)) == 1


async def test_a_raw_plaintext_dealer_gets_nothing(worker: Worker) -> None:
    """Below the gateway's code: any NULL-mechanism peer, sending at once."""
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(worker.address)
    ping = protocol.encoder().encode(protocol.Ping(gateway_id="x", sent_at=1.0))
    try:
        # Bounded: a DEALER's send waits for a peer to take it, and this one
        # may have none left once its handshake failed (it once waited out
        # the 600 s test timeout in CI). Then nothing was sent: nothing may arrive.
        await asyncio.wait_for(dealer.send(ping), ARRIVES_WITHIN)
    except TimeoutError:
        pass
    assert await worker.receive(seconds=NOTHING_FOR) is None
    dealer.close(0)
    ctx.term()


async def test_a_gateway_refuses_a_worker_with_another_key(
    worker: Worker, connect: Connect, keypairs: Keys, tmp_path: Path
) -> None:
    """The gateway authenticates the worker too: an impostor's key fails the handshake."""
    impostor_public, _ = stranger(tmp_path, "impostor")
    misled = curve_keys.CurveClient(
        keypairs.gateway.public_key, keypairs.gateway.secret_key, impostor_public
    )
    gateway = connect(worker.address, misled)
    assert await worker.receive(seconds=NOTHING_FOR) is None
    assert not gateway.connected.is_set()


@pytest.mark.parametrize("worker", [None], indirect=True)
async def test_a_curve_gateway_does_not_fall_back_to_a_plaintext_worker(
    worker: Worker, connect: Connect, keypairs: Keys
) -> None:
    gateway = connect(worker.address, keypairs.gateway)
    assert await worker.receive(seconds=NOTHING_FOR) is None
    assert not gateway.connected.is_set()


async def test_a_refused_gateway_gets_in_once_its_key_is_added_without_restarts(
    worker: Worker,
    connect: Connect,
    keypairs: Keys,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker reads its directory on each handshake; the link dials again after a
    refusal (libzmq alone would give up), so neither side needs a restart."""
    monkeypatch.setattr(transport, "REDIAL_AFTER_REFUSAL", 0.5)
    public, secret = stranger(tmp_path, "newcomer")
    newcomer = curve_keys.CurveClient(public, secret, keypairs.worker.public_key)
    gateway = connect(worker.address, newcomer)
    assert await worker.receive(seconds=1.0) is None
    shutil.copy(tmp_path / "strangers" / "newcomer.key", keypairs.worker.authorized_dir)
    assert await worker.receive(seconds=ARRIVES_WITHIN) is not None
    assert gateway.connected.is_set()


@pytest.mark.parametrize("worker", [None], indirect=True)
async def test_every_network_socket_bounds_its_messages(worker: Worker, connect: Connect) -> None:
    gateway = connect(worker.address, None)
    assert worker.router.getsockopt(zmq.MAXMSGSIZE) == protocol.MAX_MESSAGE_BYTES
    assert gateway.link.sock.getsockopt(zmq.MAXMSGSIZE) == protocol.MAX_MESSAGE_BYTES


@pytest.mark.parametrize("worker", [None], indirect=True)
async def test_a_frame_over_the_limit_is_dropped_and_the_socket_lives_on(worker: Worker) -> None:
    ctx = zmq.asyncio.Context()
    big = ctx.socket(zmq.DEALER)
    big.connect(worker.address)
    await big.send(b"\0" * (protocol.MAX_MESSAGE_BYTES + 1))
    assert await worker.receive(seconds=NOTHING_FOR) is None
    small = ctx.socket(zmq.DEALER)
    small.connect(worker.address)
    await small.send(b"fits")
    frames = await worker.receive(seconds=ARRIVES_WITHIN)
    assert frames is not None and frames[1] == b"fits"
    big.close(0)
    small.close(0)
    ctx.term()
