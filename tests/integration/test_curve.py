"""CURVE on loopback with the real worker: ``llmgate serve`` whose worker and gateway
both have keys (one engine for the module), and lone gateways with right, unknown
or no keys in front of that worker."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import zmq

from shared import curve_keys, protocol
from tests.conftest import (
    MODEL,
    ROOT,
    Served,
    engine_on_last_core,
    free_port,
    launch_serve,
    launched_ahead,
    module_system,
    start_gateway,
    stop_serve,
)
from tests.harness import prestart

pytestmark = pytest.mark.slow  # its own engine, CURVE-keyed

# Several of a refused gateway's reconnects fit in this.
NEVER_HEALTHY_FOR = 4.0


@dataclass
class KeyFiles:
    worker_secret: Path
    worker_public: Path
    gateway_secret: Path
    authorized_dir: Path
    stranger_secret: Path

    def gateway_flags(self, secret: Path) -> list[str]:
        return [
            *("--curve-gateway-key-file", str(secret)),
            *("--curve-worker-public-key-file", str(self.worker_public)),
        ]


def make_key_files(folder: Path) -> KeyFiles:
    worker_public, worker_secret = curve_keys.generate(folder / "worker", "worker")
    gateway_public, gateway_secret = curve_keys.generate(folder / "gateway", "gateway")
    authorized = folder / "authorized"
    authorized.mkdir()
    shutil.copy(gateway_public, authorized)
    _, stranger_secret = curve_keys.generate(folder / "stranger", "stranger")
    return KeyFiles(worker_secret, worker_public, gateway_secret, authorized, stranger_secret)


# This module's system (tests/harness/prestart.py): under make test its module runs in the
# session of the modules with systems of their own, which starts it as the module begins.
SYSTEM_FIXTURE = "curve_system"


def launch_system(directory: Path) -> prestart.Launched:
    """``llmgate serve`` keyed through the environment: each side reads its own names."""
    key_files = make_key_files(directory / "keys")
    env = {
        "LLMGATE_CURVE_WORKER_KEY_FILE": str(key_files.worker_secret),
        "LLMGATE_CURVE_GATEWAY_KEYS_DIR": str(key_files.authorized_dir),
        "LLMGATE_CURVE_GATEWAY_KEY_FILE": str(key_files.gateway_secret),
        "LLMGATE_CURVE_WORKER_PUBLIC_KEY_FILE": str(key_files.worker_public),
    }
    running = launch_serve(directory / "serve.log", env={**env, **engine_on_last_core()})
    return launched_ahead(running, (key_files, running))


@pytest.fixture(scope="module")
def curve_system(request: pytest.FixtureRequest) -> Iterator[tuple[KeyFiles, Served]]:
    key_files, launched = prestart.take(request)
    with module_system(launched) as running:
        yield key_files, running


@pytest.fixture(scope="module")
def key_files(curve_system: tuple[KeyFiles, Served]) -> KeyFiles:
    return curve_system[0]


@pytest.fixture(scope="module")
def curve_served(curve_system: tuple[KeyFiles, Served]) -> Served:
    return curve_system[1]


def start_unready_gateway(log_path: Path, workers: str, *flags: str) -> Served:
    """A lone gateway, returned once its HTTP server is up, healthy workers or not."""
    port = free_port()
    # A request waits --startup-timeout for a healthy worker before its 503:
    # one second, not five, as none is coming.
    argv = [
        *(sys.executable, "-m", "gateway.main", "--workers", workers, "--port", str(port)),
        *("--startup-timeout", "1"),
    ]
    log_file = log_path.open("wb")
    proc = subprocess.Popen([*argv, *flags], cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    gateway = Served(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, gateway.log_tail()
        try:
            if httpx.get(f"{gateway.base_url}/health", timeout=2).status_code == 200:
                return gateway
        except httpx.HTTPError:
            time.sleep(0.2)
    stop_serve(gateway)
    raise AssertionError(f"gateway never served /health:\n{gateway.log_tail()}")


def assert_never_healthy(gateway: Served) -> None:
    deadline = time.monotonic() + NEVER_HEALTHY_FOR
    while time.monotonic() < deadline:
        assert httpx.get(f"{gateway.base_url}/ready", timeout=60).status_code == 503
        assert httpx.get(f"{gateway.base_url}/health", timeout=60).json()["healthy_workers"] == 0
        time.sleep(0.25)
    response = httpx.post(
        f"{gateway.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 1},
        timeout=30,
    )
    assert response.status_code == 503, response.text


def chat(base_url: str) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=120,
    )


def test_the_keyed_serve_answers_over_curve(curve_served: Served) -> None:
    log = curve_served.log_path.read_text(errors="replace")
    assert "(CURVE)" in log  # the worker bound a CURVE socket
    assert "worker links: CURVE" in log
    response = chat(curve_served.base_url)
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["message"]["content"]


def test_a_lone_gateway_with_the_right_keys_becomes_ready_and_answers(
    curve_served: Served, key_files: KeyFiles, tmp_path: Path
) -> None:
    gateway = start_gateway(
        tmp_path / "gateway.log",
        curve_served.worker_addresses(),
        *key_files.gateway_flags(key_files.gateway_secret),
    )
    try:
        response = chat(gateway.base_url)
        assert response.status_code == 200, response.text
    finally:
        stop_serve(gateway)


def test_a_gateway_with_an_unknown_key_never_becomes_healthy(
    curve_served: Served, key_files: KeyFiles, tmp_path: Path
) -> None:
    gateway = start_unready_gateway(
        tmp_path / "gateway.log",
        curve_served.worker_addresses(),
        *key_files.gateway_flags(key_files.stranger_secret),
    )
    try:
        assert_never_healthy(gateway)
        stranger_key = curve_keys.load_keypair(key_files.stranger_secret)[0].decode()
        worker_log = curve_served.wait_for_log("ZAP denied a client")
        assert stranger_key in worker_log
        gateway.wait_for_log("refused this gateway's CURVE key")
    finally:
        stop_serve(gateway)


def test_a_plaintext_gateway_never_becomes_healthy(curve_served: Served, tmp_path: Path) -> None:
    gateway = start_unready_gateway(tmp_path / "gateway.log", curve_served.worker_addresses())
    try:
        assert_never_healthy(gateway)
        curve_served.wait_for_log("a client failed the handshake")
    finally:
        stop_serve(gateway)


def ping_and_listen(
    address: str, curve: curve_keys.CurveClient | None, within: float = 3.0, first: bool = False
) -> list[protocol.ToGateway]:
    """A raw DEALER: send a Ping, return what the worker sends back within
    ``within`` seconds (``first``: as soon as it has sent one message)."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(dealer)
    dealer.connect(address)
    dealer.send(protocol.encoder().encode(protocol.Ping(gateway_id="raw", sent_at=time.time())))
    received = []
    decoder = protocol.gateway_decoder()
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0 and not (first and received):
        if dealer.poll(left * 1000):
            received.append(decoder.decode(dealer.recv()))
    dealer.close(0)
    ctx.term()
    return received


def test_raw_sockets_get_heartbeats_only_with_an_authorized_key(
    curve_served: Served, key_files: KeyFiles
) -> None:
    address = curve_served.worker_addresses()
    worker_public = curve_keys.load_public_key(key_files.worker_public)

    def client(secret: Path) -> curve_keys.CurveClient:
        public, secret_key = curve_keys.load_keypair(secret)
        return curve_keys.CurveClient(public, secret_key, worker_public)

    # Its answer may take a while on a busy machine; the refusals below wait 3 s.
    answers = ping_and_listen(address, client(key_files.gateway_secret), within=60, first=True)
    assert answers and all(isinstance(a, protocol.Heartbeat) for a in answers)
    assert answers[0].models == [MODEL]
    assert ping_and_listen(address, client(key_files.stranger_secret)) == []
    assert ping_and_listen(address, None) == []
