"""The gateway's own CPU per request, without HTTP: its ASGI app driven in-process.

``make bench-overhead`` measures the whole hop through uvicorn with wrk, and
its run-to-run spread (a few percent) hides changes of a microsecond or two.
This drives the gateway's app directly (the same ASGI calls uvicorn makes)
over a FAKE worker (``loadtest.fake_engine``) and reads the process's CPU
time, so two checkouts can be told apart to about half a microsecond per
request: run with ``--baseline DIR`` (``git worktree add DIR REV``) they are
measured alternately, in child processes, each importing its own code::

    python -m loadtest.hop_cpu --baseline /tmp/old --rounds 3
    python -m loadtest.hop_cpu --concurrency 1 --profile /tmp/hop.prof

``--profile`` writes a cProfile of one more run of this checkout, not
counted (for call counts: cProfile inflates times). Figures are CPU microseconds per
request, uvicorn's share not included; docs/benchmarks.md has runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BODY = json.dumps(
    {
        "model": "smollm2-135m-instruct",
        "prompt": "Hello World, what is your name dog?",
        "max_tokens": 1,
        "stream": False,
    },
    separators=(",", ":"),
).encode()


def _fake_engine_module(root: Path) -> str:
    """Where the checkout at ``root`` keeps the fake engine (it moved on 2026-11-28)."""
    return (
        "loadtest.fake_engine"
        if (root / "loadtest/fake_engine.py").exists()
        else "worker.fake_engine"
    )


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """In the child: the app of the checkout in the current directory, measured."""
    from gateway.app import create_app_from_environment

    app = create_app_from_environment()
    lifespan: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    started = asyncio.Event()

    async def lifespan_send(message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set()

    await lifespan.put({"type": "lifespan.startup"})
    life = asyncio.create_task(
        app(
            {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
            lifespan.get,
            lifespan_send,
        )
    )  # type: ignore[arg-type]
    await started.wait()

    async def call(method: str, path: str, body: bytes = b"") -> int:
        done = asyncio.Event()
        sent = False
        status = 0

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"127.0.0.1"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 5555),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }
        await app(scope, receive, send)  # type: ignore[arg-type]
        return status

    deadline = time.monotonic() + 60
    while await call("GET", "/ready") != 200:
        if time.monotonic() > deadline:
            raise SystemExit("the gateway found no healthy fake worker within 60 s")
        await asyncio.sleep(0.1)

    async def user(requests: int) -> None:
        for _ in range(requests):
            status = await call("POST", "/v1/completions", BODY)
            if status != 200:
                raise SystemExit(f"a request answered {status}")

    per_user = max(1, args.requests // args.concurrency)
    await asyncio.gather(*(user(max(1, per_user // 4)) for _ in range(args.concurrency)))  # warm
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(user(per_user) for _ in range(args.concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    done = per_user * args.concurrency
    await lifespan.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(life, 30)
    return {"cpu_us_per_request": cpu / done * 1e6, "requests_per_s": done / wall}


def _child(args: argparse.Namespace) -> None:
    import uvloop

    sys.path.insert(0, os.getcwd())  # the checkout's gateway, not this one's
    with socket.socket() as probe:  # a free port (any checkout has this much)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    worker_argv = [sys.executable, "-m", _fake_engine_module(Path.cwd()), "--bind", address]
    if args.worker_core is not None:
        worker_argv = ["taskset", "-c", str(args.worker_core), *worker_argv]
    worker = subprocess.Popen(worker_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ["LLMGATE_WORKERS"] = address
    os.environ["LLMGATE_LOG_LEVEL"] = "error"
    uvloop.install()
    try:
        print(json.dumps(asyncio.run(_measure(args))), flush=True)
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def _run(checkout: Path, args: argparse.Namespace, profile: str = "") -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child"]
    argv += ["--requests", str(args.requests), "--concurrency", str(args.concurrency)]
    if profile:
        argv += ["--profile", profile]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # the gateway on one core, its fake worker on another
        argv = ["taskset", "-c", str(cores[0]), *argv, "--worker-core", str(cores[1])]
    out = subprocess.run(argv, cwd=checkout, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{checkout}: {out.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.hop_cpu", description=__doc__)
    parser.add_argument("--baseline", type=Path, help="another checkout, measured alternately")
    parser.add_argument("--requests", type=int, default=30_000, help="per measured run")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each checkout")
    parser.add_argument("--profile", default="", help="cProfile this checkout's run to FILE")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-core", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return
    checkouts = {"this": ROOT}
    if args.baseline is not None:
        checkouts["baseline"] = args.baseline.resolve()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    for _ in range(args.rounds):
        for name, checkout in checkouts.items():
            runs[name].append(_run(checkout, args))
    if args.profile:  # one more run, not counted: cProfile slows what it watches
        _run(ROOT, args, args.profile)
    print(f"{args.rounds} runs of {args.requests} requests at concurrency {args.concurrency}")
    for name, results in runs.items():
        cpu = [r["cpu_us_per_request"] for r in results]
        rate = [r["requests_per_s"] for r in results]
        print(
            f"  {name:9} CPU per request {statistics.median(cpu):6.1f} us "
            f"[{min(cpu):.1f}-{max(cpu):.1f}]   {statistics.median(rate):,.0f} requests/s"
            + (f"   ({checkouts[name]})" if name != "this" else "")
        )


if __name__ == "__main__":
    main()
