"""A rolling restart (SIGHUP to ``llmgate serve``'s launcher) under streams, on held doubles.

The launcher (``serve.supervisor``) keeps two held workers and a round-robin
gateway. Streams sent one after another land half on each and hold after
their first tokens, so they are under way through the whole roll. SIGHUP:
worker-0 drains, the gateway moves its streams on to worker-1, it restarts
and rejoins; then worker-1 the same, its streams (worker-0's among them)
moving on to the new worker-0. Once the roll is done and the new processes
let go, every stream ends whole: no client saw the restarts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import zmq

from shared.ports import free_port
from tests.conftest import MODEL, PATIENCE, ROOT
from tests.faults.held import BODY, HOLD_AFTER
from tests.faults.test_migration import STREAMS, start_streams, whole
from tests.harness.waiting import wait_until
from tests.integration.test_pool import metric
from tests.serve.test_serve import Output, stop

LAUNCHER = """\
import json, sys
from shared.logs import setup_logging
from shared.settings import ServeSettings
from serve import children, supervisor

spec = json.loads(sys.argv[1])
setup_logging("info")
started = [
    children.Child(name=f"worker-{i}", argv=argv, env=spec["env"], port=port, worker=True)
    for i, (argv, port) in enumerate(spec["workers"])
]
gateway = spec["gateway"]
started.append(children.Child(name="gateway", argv=gateway, env=spec["env"], port=spec["port"]))
serve = ServeSettings(host="127.0.0.1", port=spec["port"])
sys.exit(supervisor.Supervisor(serve, started).run())
"""


def release(control: str, output: Output) -> None:
    with zmq.Context.instance().socket(zmq.PUSH) as sock:
        sock.setsockopt(zmq.LINGER, 60_000)
        sock.connect(control)
        sock.send(b"release")
    output.wait_for("fake engine: release")


def test_a_rolling_restart_moves_every_stream_on_and_no_client_sees_it() -> None:
    port = free_port()
    workers, controls = [], []
    for i in range(2):
        worker_port, control = free_port(), f"tcp://127.0.0.1:{free_port()}"
        argv = [
            *(sys.executable, "-m", "loadtest.fake_engine"),
            *("--bind", f"tcp://127.0.0.1:{worker_port}", "--worker-id", f"worker-{i}"),
            *("--served-model-name", MODEL, "--hold-after", str(HOLD_AFTER)),
            *("--control", control, "--gateway-timeout", "600", "--log-level", "info"),
        ]
        workers.append((argv, worker_port))
        controls.append(control)
    addresses = ",".join(f"tcp://127.0.0.1:{p}" for _, p in workers)
    gateway = [
        *(sys.executable, "-m", "gateway.main", "--workers", addresses, "--port", str(port)),
        *("--policy", "round-robin", "--log-level", "info"),
    ]
    spec = {"workers": workers, "gateway": gateway, "port": port, "env": {**os.environ, **PATIENCE}}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, json.dumps(spec)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = Output(proc)
    base_url = f"http://127.0.0.1:{port}"
    try:

        def both_healthy() -> bool:
            try:
                return httpx.get(f"{base_url}/health", timeout=5).json()["healthy_workers"] == 2
            except httpx.HTTPError:
                return False

        wait_until(both_healthy, "both workers healthy", timeout=120)

        async def scenario() -> list[object]:
            async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
                streams = await start_streams(client, BODY)
                proc.send_signal(signal.SIGHUP)
                await asyncio.to_thread(output.wait_for, "rolling restart done", 240)
                # The held streams are all on the new worker-0 now.
                for control in controls:
                    await asyncio.to_thread(release, control, output)
                return list(await asyncio.gather(*streams))

        streams = asyncio.run(scenario())
        moved = metric(base_url, "llmgate_migrations_total", reason="worker_draining")
    finally:
        stop(proc, output)
    text = output.rest()
    assert all(whole(s) for s in streams), streams  # type: ignore[arg-type]
    # Worker-0's streams moved twice (to worker-1, then back to the new
    # worker-0), worker-1's once.
    assert moved == STREAMS // 2 * 2 + STREAMS // 2, text
    for name in ("worker-0", "worker-1"):
        assert f"rolling restart: {name} drained in" in text, text
        assert f"rolling restart: {name} is back (2 of 2 workers serving)" in text, text
    # Drained and started again by the roll, not restarted as a crash.
    assert "restart 1 in" not in text and "stream cut" not in text, text
    assert proc.returncode == 0, text
