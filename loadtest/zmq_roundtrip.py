"""The floor under the gateway's added latency: one ZeroMQ round trip between two Python processes.

A DEALER in one process sends a small frame to a ROUTER in another, which
sends it straight back; one message in flight at a time, both ends read by
:class:`shared.zmqio.Reader` on a uvloop event loop, exactly as the gateway
and the worker read their sockets, and pinned to cores as
``loadtest.overhead`` pins the gateway (``--client-core``) and the worker
(``--server-core``). Nothing else happens per message, so the mean round
trip is what the gateway -> worker -> gateway hop costs before either side
does any work::

    .venv/bin/python -m loadtest.zmq_roundtrip --messages 20000
    .venv/bin/python -m loadtest.zmq_roundtrip --transport ipc   # a Unix socket
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

import uvloop
import zmq

from shared.ports import free_port
from shared.zmqio import Reader

PAYLOAD = b"x" * 200  # about a Generate message for a short prompt


async def _echo(address: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    done = asyncio.Event()

    def on_message(frames: list[bytes]) -> None:
        if frames[1] == b"stop":
            done.set()
        sock.send_multipart(frames, zmq.NOBLOCK)
        reader.after_send()

    reader: Reader[list[bytes]] = Reader(sock, on_message, multipart=True)
    reader.start()
    await done.wait()
    reader.stop()
    sock.close(0)
    ctx.term()


async def _client(address: str, messages: int, warmup: int) -> list[float]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def on_message(_frame: bytes) -> None:
        if not waiter.done():
            waiter.set_result(None)

    reader: Reader[bytes] = Reader(sock, on_message, multipart=False)
    reader.start()
    times = []
    for n in range(warmup + messages):
        waiter = loop.create_future()
        start = time.perf_counter()
        sock.send(PAYLOAD, zmq.NOBLOCK if n else 0)
        reader.after_send()
        await waiter
        if n >= warmup:
            times.append(time.perf_counter() - start)
    sock.send(b"stop")
    reader.stop()
    sock.close(0)
    ctx.term()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--warmup", type=int, default=1_000)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    parser.add_argument("--port", type=int, help="tcp's port (default: a free one)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the echo process
    args = parser.parse_args(argv)
    if args.serve:
        uvloop.run(_echo(args.serve))
        return
    if args.transport == "ipc":
        # The socket's directory, removed when this process exits.
        sockets = tempfile.TemporaryDirectory(prefix="llmgate-rt-")
        address = f"ipc://{sockets.name}/echo.sock"
    else:
        address = f"tcp://127.0.0.1:{args.port or free_port()}"
    cores = os.cpu_count() or 1
    pin = cores > max(args.client_core, args.server_core)
    echo_argv = [sys.executable, "-m", "loadtest.zmq_roundtrip", "--serve", address]
    if pin:
        echo_argv = ["taskset", "-c", str(args.server_core), *echo_argv]
        os.sched_setaffinity(0, {args.client_core})
    echo = subprocess.Popen(echo_argv)
    try:
        time.sleep(1.0)  # the echo binds
        times = uvloop.run(_client(address, args.messages, args.warmup))
    finally:
        echo.wait(timeout=10)
    micros = sorted(t * 1e6 for t in times)
    print(
        f"ZeroMQ round trip over {args.transport}, {len(micros)} messages"
        f" of {len(PAYLOAD)} bytes, one in flight"
        f"{f' (client core {args.client_core}, echo core {args.server_core})' if pin else ''}: "
        f"mean {statistics.fmean(micros):.0f} us, p50 {micros[len(micros) // 2]:.0f} us, "
        f"p99 {micros[int(len(micros) * 0.99)]:.0f} us"
    )


if __name__ == "__main__":
    main()
