"""A SIMULATED fleet: the real gateway's routing policies in front of dozens of engines.

``make bench ARGS="--scenario fleet"`` (or ``python -m loadtest.fleet``).
``--engines`` (32) simulated engines (``loadtest.sim_engine``: a modelled
paged prefix cache each, publishing KV events in vLLM's wire format) run in
one process; in front of them, for each ``--gateways`` count (1 and 8) and
each policy (round-robin, least-load, prefix, kv), that many real gateway
processes, the clients taking turns between them. Each workload runs on
empty caches:

* ``agents``: ``--agents`` (8) sets of instructions of about 1,000 tokens,
  each shared by many users (``--users``, 1,024); every user holds a
  conversation of ``--turns`` (8) turns (its history grows). Long enough
  that each engine serves many conversations of an agent: spreading 8
  agents over 32 engines computes each agent's instructions on several
  engines, a cost no balanced routing avoids, which at 128 users of 4
  turns came to 0.6x the floor or more;
* ``rag``: documents of about 1,500 tokens filling half of the fleet's cache
  in all, each behind 4 different questions in a shuffled order: each
  engine's share fits its cache, every document everywhere would not;
* ``hot``: ``--hot-requests`` (5,000), 80% of them behind one system
  prompt of about 1,000 tokens, the rest behind prompts of their own;
* ``churn``: the agents workload while an engine restarts every
  ``--churn-every`` (2) seconds, the next one each time: its requests are
  lost mid-answer (they move on), its cache is empty, and it comes back as
  a new incarnation (as an engine that joins would).

Reported per workload, policy and gateway count: the prompt tokens the
engines computed against the floor (what one infinite cache shared by all
engines would compute), the cache hit rate (tokens), the busiest engine's
requests and load (the seconds it held requests) against the mean, the
modelled TTFT p50 and p99 (the clients' times: the model's prefill and
decode times plus this machine's own), and errors. A plot of
computed/floor per policy and gateway count goes beside the table
(``fleet.png``). Every figure is SIMULATED: engines, caches and
times are a model; only the gateway and its policies are real.

Results go to ``loadtest/results/<UTC time>-fleet/``, each run's per-engine
counts beside them (``engines-<workload>-<policy>-<gateways>.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import zmq

from loadtest import targets
from loadtest.conversations import text
from loadtest.percentiles import percentile
from loadtest.procs import await_ready, healthy_workers, launched
from loadtest.report import ROOT, markdown_table, ms, results_dir, write_json_and_csv
from loadtest.sim_engine import CacheModel
from shared.ports import free_port, free_port_range

POLICIES = ("round-robin", "least-load", "prefix", "kv")
WORKLOADS = ("agents", "rag", "hot", "churn")
# Words of a text, for about the tokens asked (the embedded tokenizer makes
# about 1.4 tokens of each of conversations' words).
TOKENS_PER_WORD = 1.4


@dataclass
class Request:
    messages: list[dict[str, str]]
    # The conversation it continues (agents), whose next turn waits for it.
    user: int = -1


@dataclass
class RunResult:
    workload: str
    policy: str
    gateways: int
    requests: int
    errors: int
    computed_tokens: int
    floor_tokens: int
    against_floor: float
    hit_rate: float
    busiest_against_mean: float
    busiest_load_against_mean: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    seconds: float


def words(tokens: int) -> int:
    return max(1, round(tokens / TOKENS_PER_WORD))


def agents(args: argparse.Namespace, tag: str) -> list[list[Request]]:
    """One list per user: its turns, each sent once the one before is answered."""
    instructions = [
        f"[{tag}] You are agent {a}. Follow these instructions: "
        + text(random.Random(f"agent-{a}"), words(1000))
        for a in range(args.agents)
    ]
    users = []
    for user in range(args.users):
        history = [{"role": "system", "content": instructions[user % args.agents]}]
        turns = []
        for turn in range(args.turns):
            history = [
                *history,
                {"role": "user", "content": text(random.Random(f"u{user}-{turn}"), 40)},
            ]
            turns.append(Request(list(history), user))
            history = [*history, {"role": "assistant", "content": "sim" * args.max_tokens}]
        users.append(turns)
    return users


def rag(args: argparse.Namespace, tag: str, cache_tokens: int) -> list[list[Request]]:
    documents = max(2, cache_tokens // 2 // 1500)
    pairs = [(d, q) for d in range(documents) for q in range(4)]
    random.Random("fleet-rag").shuffle(pairs)
    texts = [
        f"[{tag}] Document {d}: " + text(random.Random(f"doc-{d}"), words(1500))
        for d in range(documents)
    ]
    return [
        [
            Request(
                [
                    {"role": "system", "content": texts[d]},
                    {"role": "user", "content": f"Question {q}: " + text(random.Random(q), 12)},
                ]
            )
        ]
        for d, q in pairs
    ]


def hot(args: argparse.Namespace, tag: str) -> list[list[Request]]:
    rng = random.Random("fleet-hot")
    shared = f"[{tag}] The one system prompt: " + text(random.Random("hot"), words(1000))
    out = []
    for i in range(args.hot_requests):
        system = (
            shared
            if rng.random() < 0.8
            else f"[{tag}] Prompt {i}: " + text(random.Random(f"cold-{i}"), words(1000))
        )
        question = f"Request {i}: " + text(random.Random(i), 12)
        out.append(
            [
                Request(
                    [{"role": "system", "content": system}, {"role": "user", "content": question}]
                )
            ]
        )
    return out


async def drive(
    urls: list[str],
    streams: list[list[Request]],
    clients: int,
    max_tokens: int,
    fleet: FleetProcess | None = None,
    churn_every: float = 0.0,
) -> tuple[list[float], int, float]:
    """Every stream's requests in order, ``clients`` streams at a time (client i uses
    ``urls[i % len(urls)]``); returns the TTFTs in ms, the errors (an HTTP
    error or an error event) and the seconds. With ``churn_every``, an engine
    of ``fleet`` restarts that often, the next one each time."""
    pending = list(reversed(streams))
    ttfts: list[float] = []
    errors = 0

    async def client(i: int) -> None:
        nonlocal errors
        limits = httpx.Limits(max_connections=4)
        async with httpx.AsyncClient(base_url=urls[i % len(urls)], timeout=300, limits=limits) as c:
            while pending:
                for request in pending.pop():
                    body = {
                        "model": targets.MODEL,
                        "messages": request.messages,
                        "max_tokens": max_tokens,
                        "stream": True,
                    }
                    start = time.perf_counter()
                    first = None
                    try:
                        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                            if r.status_code != 200:
                                await r.aread()
                                errors += 1
                                break
                            async for line in r.aiter_lines():
                                if line.startswith('data: {"error"'):
                                    errors += 1
                                elif first is None and line.startswith("data: {"):
                                    first = time.perf_counter()
                    except httpx.HTTPError:
                        errors += 1
                        break
                    if first is not None:
                        ttfts.append((first - start) * 1000)

    done = asyncio.Event()

    async def restarts() -> None:
        # Not cancelled mid-ask: the control socket must get its reply.
        assert fleet is not None
        for engine in itertools.count():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), churn_every)
            if done.is_set():
                return
            await asyncio.to_thread(fleet.ask, f"restart {engine}")

    started = time.perf_counter()
    churning = asyncio.create_task(restarts()) if churn_every > 0 and fleet is not None else None
    try:
        await asyncio.gather(*(client(i) for i in range(clients)))
    finally:
        done.set()
        if churning is not None:
            await churning
    return ttfts, errors, time.perf_counter() - started


class FleetProcess:
    """The simulated engines' process, and its control socket."""

    def __init__(self, stack: contextlib.ExitStack, args: argparse.Namespace, run_dir: Path):
        base, events = free_port_range(args.engines), free_port_range(args.engines)
        self.addresses = [f"tcp://127.0.0.1:{base + i}" for i in range(args.engines)]
        control = f"tcp://127.0.0.1:{free_port()}"
        argv = [
            *(sys.executable, "-m", "loadtest.sim_engine", "--engines", str(args.engines)),
            *("--base-port", str(base), "--events-base-port", str(events)),
            *("--control", control, "--cache-blocks", str(args.cache_blocks)),
        ]
        stack.enter_context(launched("simulated engines", argv, run_dir / "engines.log", cwd=ROOT))
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.RCVTIMEO, 60_000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(control)
        stack.callback(self.ctx.destroy, 0)

    def ask(self, word: str) -> dict[str, Any]:
        self.sock.send(word.encode())
        reply: dict[str, Any] = json.loads(self.sock.recv())
        return reply


@contextlib.contextmanager
def gateways(
    policy: str, count: int, addresses: list[str], run_dir: Path, extra: list[str]
) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        started = []
        for g in range(count):
            port = free_port()
            argv = [
                *(sys.executable, "-m", "gateway.main", "--workers", ",".join(addresses)),
                *("--port", str(port), "--policy", policy, "--log-level", "warning"),
                *extra,
            ]
            log = run_dir / f"gateway-{policy}-{count}-{g}.log"
            proc = stack.enter_context(launched(f"gateway {policy} {g}", argv, log, cwd=ROOT))
            started.append((proc, log, f"http://127.0.0.1:{port}"))
        for g, (proc, log, url) in enumerate(started):
            check = healthy_workers(len(addresses))
            await_ready(f"gateway {policy} {g}", proc, log, url + "/ready", 120.0, check)
            urls.append(url)
        yield urls


def summarize(
    workload: str,
    policy: str,
    count: int,
    stats: dict[str, Any],
    ttfts: list[float],
    errors: int,
    seconds: float,
) -> RunResult:
    engines = stats["engines"]
    prompt = sum(e["prompt_tokens"] for e in engines)
    cached = sum(e["cached_tokens"] for e in engines)
    requests = [e["requests"] for e in engines]
    mean = sum(requests) / len(requests) if requests else 0
    held = [e.get("held_seconds", 0.0) for e in engines]
    mean_held = sum(held) / len(held) if held else 0
    floor = stats["floor_tokens"]
    return RunResult(
        workload=workload,
        policy=policy,
        gateways=count,
        requests=sum(requests),
        errors=errors,
        computed_tokens=prompt - cached,
        floor_tokens=floor,
        against_floor=(prompt - cached) / floor if floor else 0.0,
        hit_rate=cached / prompt if prompt else 0.0,
        busiest_against_mean=max(requests) / mean if mean else 0.0,
        busiest_load_against_mean=max(held) / mean_held if mean_held else 0.0,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        seconds=seconds,
    )


TABLE_HEADER = (
    "workload",
    "policy",
    "gateways",
    "computed / floor",
    "hit rate",
    "busiest / mean (requests)",
    "busiest / mean (load)",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "requests",
    "errors",
)


def format_table(results: list[RunResult]) -> str:
    rows = [
        [
            r.workload,
            r.policy,
            str(r.gateways),
            f"{r.against_floor:.2f}",
            f"{r.hit_rate:.2f}",
            f"{r.busiest_against_mean:.2f}",
            f"{r.busiest_load_against_mean:.2f}",
            ms(r.ttft_p50_ms),
            ms(r.ttft_p99_ms),
            str(r.requests),
            str(r.errors),
        ]
        for r in results
    ]
    return markdown_table(TABLE_HEADER, rows)


def verdicts(results: list[RunResult]) -> list[str]:
    """The issue's targets, read from the kv rows (SIMULATED)."""
    lines = []
    kv = {(r.workload, r.gateways): r for r in results if r.policy == "kv"}
    for (workload, count), r in sorted(kv.items()):
        if workload in ("agents", "rag"):
            met = r.against_floor <= 1.15
            lines.append(
                f"{workload}, {count} gateway(s): kv computes {r.against_floor:.2f}x the floor "
                f"(target <= 1.15): {'met' if met else 'NOT met'}"
            )
        if workload == "hot":
            busiest = r.busiest_load_against_mean
            lines.append(
                f"hot, {count} gateway(s): busiest engine's load {busiest:.2f}x "
                f"the mean (target <= 1.3): {'met' if busiest <= 1.3 else 'NOT met'}"
            )
    counts = sorted({c for _, c in kv})
    if len(counts) > 1:
        for workload in WORKLOADS:
            one, most = kv.get((workload, counts[0])), kv.get((workload, counts[-1]))
            if one and most and one.hit_rate:
                ratio = most.hit_rate / one.hit_rate
                lines.append(
                    f"{workload}: hit rate at {counts[-1]} gateways / at {counts[0]}: "
                    f"{ratio:.2f} (target >= 0.95): {'met' if ratio >= 0.95 else 'NOT met'}"
                )
    return lines


def plot(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(4 * len(WORKLOADS), 3.5), sharey=True)
    counts = sorted({r.gateways for r in results})
    for ax, workload in zip(axes, WORKLOADS, strict=True):
        for policy in POLICIES:
            rows = [r for r in results if r.workload == workload and r.policy == policy]
            rows.sort(key=lambda r: r.gateways)
            if rows:
                ax.plot(
                    [r.gateways for r in rows], [r.against_floor for r in rows], "o-", label=policy
                )
        ax.set_title(workload)
        ax.set_xticks(counts)
        ax.set_xlabel("gateway processes")
    axes[0].set_ylabel("prompt tokens computed / floor")
    axes[-1].legend()
    fig.suptitle("SIMULATED fleet: engines and caches modelled, gateways real")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.fleet",
        description="The gateway's policies in front of a SIMULATED fleet of engines.",
    )
    parser.add_argument("--engines", type=int, default=32)
    parser.add_argument("--gateways", default="1,8", help="gateway process counts, comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--cache-blocks", type=int, default=CacheModel.cache_blocks)
    parser.add_argument("--agents", type=int, default=8, help="instruction sets (agents)")
    parser.add_argument("--users", type=int, default=1024, help="conversations (agents)")
    parser.add_argument("--turns", type=int, default=8, help="turns of a conversation (agents)")
    parser.add_argument("--hot-requests", type=int, default=5000)
    parser.add_argument(
        "--churn-every", type=float, default=2.0, help="seconds between restarts (churn)"
    )
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per answer")
    parser.add_argument(
        "--gateway-args", default="", help="more flags for every gateway (one string)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    counts = [int(c) for c in args.gateways.split(",") if c]
    policies = [p for p in args.policies.split(",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    if set(policies) - set(POLICIES) or set(workloads) - set(WORKLOADS) or not counts:
        raise SystemExit(
            f"--policies from {', '.join(POLICIES)}; --workloads from {', '.join(WORKLOADS)}"
        )
    started = datetime.now(UTC)
    run_dir = results_dir("fleet", started)
    print(f"results and logs: {run_dir.relative_to(ROOT)}/ (SIMULATED engines)", flush=True)
    cache_tokens = args.engines * args.cache_blocks * CacheModel.block_size
    results: list[RunResult] = []
    with contextlib.ExitStack() as stack:
        fleet = FleetProcess(stack, args, run_dir)
        for count in counts:
            for policy in policies:
                extra = args.gateway_args.split()
                with gateways(policy, count, fleet.addresses, run_dir, extra) as urls:
                    for workload in workloads:
                        tag = f"{workload} {policy} {count} {started:%H%M%S}"
                        if workload in ("agents", "churn"):
                            streams = agents(args, tag)
                        elif workload == "rag":
                            streams = rag(args, tag, cache_tokens)
                        else:
                            streams = hot(args, tag)
                        fleet.ask("clear")
                        churn = args.churn_every if workload == "churn" else 0.0
                        ttfts, errors, seconds = asyncio.run(
                            drive(urls, streams, args.clients, args.max_tokens, fleet, churn)
                        )
                        stats = fleet.ask("stats")
                        # Each engine's counts, for telling which one was busiest and why.
                        engines_file = run_dir / f"engines-{workload}-{policy}-{count}.json"
                        engines_file.write_text(json.dumps(stats, indent=1))
                        result = summarize(workload, policy, count, stats, ttfts, errors, seconds)
                        results.append(result)
                        print(format_table([result]).splitlines()[-1], flush=True)
    title = (
        f"{started:%Y-%m-%d %H:%M} UTC, SIMULATED: {args.engines} engines of "
        f"{args.cache_blocks} blocks of {CacheModel.block_size} tokens, {args.clients} clients"
    )
    write_json_and_csv(
        run_dir,
        {
            "date": started.isoformat(),
            "title": title,
            "parameters": vars(args),
            "simulated": True,
            "results": [asdict(r) for r in results],
            "verdicts": verdicts(results),
        },
        results,
    )
    with contextlib.suppress(ImportError):
        plot(results, run_dir / "fleet.png")
    print()
    print(title)
    print(format_table(results))
    for line in verdicts(results):
        print(line)
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
