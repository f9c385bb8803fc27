"""Multi-turn chat over two workers: does the ``prefix`` policy turn vLLM's
prefix cache into shorter times to first token?

``make bench ARGS="--scenario multiturn"`` (or ``python -m loadtest.multiturn``).
Two real workers (the embedded model, each pinned to its own core slice as
``llmgate serve --num-workers 2`` pins them) start once; then, for each
policy in turn (``prefix``, ``least-load``, ``round-robin``, ``kv``), a gateway with
that ``--policy`` starts in front of them and ``--users`` simulated users
(16) each hold a conversation of ``--turns`` (8) turns: a system prompt
shared by all (``--system-words``, 150), then their own user messages
(``--user-words``, 50 words each, their own text), each answered with
``--max-tokens`` (64) tokens (greedy, ``ignore_eos``) that join the history
before the next turn; short questions and longer answers, as in real chats
(LMSYS-Chat-1M averages about 70 prompt and 215 answer tokens a turn).

The conversations arrive as a Poisson process of ``--arrival-rate`` (0.1) a
second, the same arrival times under every policy, as on a public
endpoint: the offered load is then the same under every policy, and what a
policy saves shows as shorter waits rather than as more requests a second
(compare at a rate every policy keeps up with: the requests/s column
equal). A user pauses ``--think-time`` (4) seconds on average before each
turn, the first included (exponential, the same pauses under every policy),
as people read and type. ``--arrival-rate 0 --think-time 0`` is a closed loop instead:
every user starts at once and sends its next turn as soon as the last
answer ends; there a worker's slot freed by a user's last answer is what
draws its next turn back, so any load-aware policy looks like affinity.

Each policy's run starts every text with its own tag, so nothing one run
put in a worker's prefix cache helps the next. Reported per policy: mean and
p99 TTFT over all turns (and over turns 2+, where the history exists), mean
end-to-end latency, requests/s and output tokens/s over the run, and each
worker's prefix-cache hit rate in the run (vLLM's ``vllm:prefix_cache_hits``
over ``vllm:prefix_cache_queries``, in tokens, from the workers' metrics),
the turns that moved to another worker than their conversation's turn
before, and the load each turn met; ``results.json`` lists every turn.

Results go to ``loadtest/results/<UTC time>-multiturn/`` (``results.json``,
``results.csv``, the logs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest import targets
from loadtest.conversations import Turn, run_policy
from loadtest.machine import vllm_version
from loadtest.percentiles import mean, percentile
from loadtest.procs import await_ready, healthy_workers, launched
from loadtest.report import ROOT, markdown_table, ms, results_dir, write_json_and_csv
from shared.ports import free_port

POLICIES = ("prefix", "least-load", "round-robin", "kv")
TARGET_TTFT_RATIO = 1.5
# "Equal or better throughput": the arrivals and pauses, so the offered load,
# are the same under every policy, and every policy serves all of it; the
# tokens/s then differ only by when the run's last answer happens to end
# (0.3% in the run of 2026-11-26 04:57), so within 2% counts as equal.
EQUAL_THROUGHPUT = 0.98


@dataclass
class PolicyResult:
    policy: str
    requests: int
    errors: int
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    mean_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_ttft_later_turns_ms: float | None
    mean_latency_ms: float | None
    prefix_cache_hit_rate: list[float | None] = field(default_factory=list)
    requests_per_worker: dict[str, int] = field(default_factory=dict)
    # Mean TTFT of each turn number (1, 2, ...), to see the history's effect.
    mean_ttft_by_turn_ms: list[float | None] = field(default_factory=list)
    # Turns 2+ answered by another worker than the turn before (which then
    # recomputes the whole history), and their mean TTFT.
    moved_turns: int = 0
    mean_ttft_moved_ms: float | None = None
    # Mean number of this run's turns running on the answering worker when a
    # turn was sent: a pile-up on one worker shows here, a machine stall not.
    mean_load_at_send: float | None = None


def moved(turns: list[Turn]) -> list[Turn]:
    """Turns answered by another worker than their conversation's turn before."""
    last: dict[int, str] = {}
    out = []
    for t in sorted(turns, key=lambda t: (t.user, t.turn)):
        if t.worker and last.get(t.user, t.worker) != t.worker:
            out.append(t)
        if t.worker:
            last[t.user] = t.worker
    return out


def load_at_send(turn: Turn, turns: list[Turn]) -> int:
    """Other turns running on ``turn``'s worker when it was sent."""
    return sum(
        1
        for o in turns
        if o is not turn
        and o.worker == turn.worker
        and o.started_s <= turn.started_s < o.started_s + o.latency_s
    )


def prefix_counters(metrics_url: str) -> tuple[float, float]:
    """(queries, hits) of vLLM's prefix cache in tokens, from a worker's /metrics."""
    page = httpx.get(metrics_url, timeout=10).text
    queries = hits = 0.0
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "vllm:prefix_cache_queries_total":
                queries += sample.value
            elif sample.name == "vllm:prefix_cache_hits_total":
                hits += sample.value
    return queries, hits


def summarize(
    policy: str, turns: list[Turn], seconds: float, rates: list[float | None]
) -> PolicyResult:
    ok = [t for t in turns if t.error is None]
    per_worker: dict[str, int] = {}
    for t in ok:
        per_worker[t.worker] = per_worker.get(t.worker, 0) + 1
    went = [t for t in moved(ok) if t.ttft_s is not None]
    ttfts = [t.ttft_s * 1000 for t in ok if t.ttft_s is not None]
    later = [t.ttft_s * 1000 for t in ok if t.ttft_s is not None and t.turn > 1]

    return PolicyResult(
        policy=policy,
        requests=len(ok),
        errors=len(turns) - len(ok),
        seconds=seconds,
        requests_per_s=len(ok) / seconds,
        output_tokens_per_s=sum(t.output_tokens for t in ok) / seconds,
        mean_ttft_ms=mean(ttfts),
        p99_ttft_ms=percentile(ttfts, 99),
        mean_ttft_later_turns_ms=mean(later),
        mean_latency_ms=mean([t.latency_s * 1000 for t in ok]),
        prefix_cache_hit_rate=rates,
        requests_per_worker=per_worker,
        mean_ttft_by_turn_ms=[
            mean([t.ttft_s * 1000 for t in ok if t.ttft_s is not None and t.turn == n])
            for n in range(1, max((t.turn for t in turns), default=0) + 1)
        ],
        moved_turns=len(went),
        mean_ttft_moved_ms=mean([t.ttft_s * 1000 for t in went if t.ttft_s is not None]),
        mean_load_at_send=mean([float(load_at_send(t, ok)) for t in ok]),
    )


@contextlib.contextmanager
def gateway(policy: str, addresses: list[str], run_dir: Path, name: str = "") -> Any:
    """A gateway with ``--policy policy`` over ``addresses``, ready; yields its URL."""
    name = name or policy
    port = free_port()
    argv = [
        *(sys.executable, "-m", "gateway.main", "--workers", ",".join(addresses)),
        *("--port", str(port), "--policy", policy),
    ]
    log = run_dir / f"gateway-{name}.log"
    with launched(f"gateway {name}", argv, log, cwd=ROOT) as proc:
        url = f"http://127.0.0.1:{port}"
        await_ready(
            f"gateway {name}",
            proc,
            log,
            url + "/ready",
            60.0,
            healthy_workers(len(addresses)),
        )
        yield url


def start_workers(
    stack: contextlib.ExitStack, engine: targets.Engine, run_dir: Path, startup_timeout: float
) -> tuple[list[str], list[str]]:
    """Two workers, each on its own core slice, publishing KV cache events (the kv
    policy's); returns their addresses and metrics URLs once both engines are up."""
    addresses, metrics_urls = [], []
    procs = []
    for i, cpu_slice in enumerate(targets.core_slices(2)):
        address, metrics_port = f"tcp://127.0.0.1:{free_port()}", free_port()
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
        }
        argv = [
            *(sys.executable, "-m", "worker.main", "--bind", address),
            *("--worker-id", f"worker-{i}", "--metrics-port", str(metrics_port)),
            *("--kv-events-config", json.dumps(events)),
            *engine.flags,
        ]
        log = run_dir / f"worker-{i}.log"
        env = targets.engine_env(cpu_slice)
        procs.append(stack.enter_context(launched(f"worker-{i}", argv, log, env, ROOT)))
        addresses.append(address)
        metrics_urls.append(f"http://127.0.0.1:{metrics_port}/metrics")
    for i, (proc, url) in enumerate(zip(procs, metrics_urls, strict=True)):
        # The metrics port opens with the worker's socket, once the engine is up.
        await_ready(f"worker-{i}", proc, run_dir / f"worker-{i}.log", url, startup_timeout)
    return addresses, metrics_urls


TABLE_HEADER = (
    "policy",
    "mean TTFT ms",
    "p99 TTFT ms",
    "mean TTFT turns 2+ ms",
    "mean latency ms",
    "req/s",
    "tok/s",
    "prefix-cache hit rate per worker",
    "requests per worker",
    "errors",
)


def format_table(results: list[PolicyResult]) -> str:
    def row(r: PolicyResult) -> list[str]:
        rates = ", ".join("-" if x is None else f"{x:.0%}" for x in r.prefix_cache_hit_rate)
        spread = ", ".join(f"{n}" for _, n in sorted(r.requests_per_worker.items()))
        return [
            r.policy,
            ms(r.mean_ttft_ms),
            ms(r.p99_ttft_ms),
            ms(r.mean_ttft_later_turns_ms),
            ms(r.mean_latency_ms),
            f"{r.requests_per_s:.2f}",
            f"{r.output_tokens_per_s:.1f}",
            rates,
            spread,
            f"{r.errors}",
        ]

    return markdown_table(TABLE_HEADER, map(row, results))


def verdict(results: list[PolicyResult]) -> str | None:
    by = {r.policy: r for r in results}
    prefix, rr = by.get("prefix"), by.get("round-robin")
    if not prefix or not rr or not prefix.mean_ttft_ms or not rr.mean_ttft_ms:
        return None
    ratio = rr.mean_ttft_ms / prefix.mean_ttft_ms
    throughput = prefix.output_tokens_per_s / rr.output_tokens_per_s
    met = ratio >= TARGET_TTFT_RATIO and throughput >= EQUAL_THROUGHPUT
    return (
        f"round-robin mean TTFT / prefix mean TTFT: {ratio:.2f}x (target >= "
        f"{TARGET_TTFT_RATIO}); prefix throughput / round-robin: {throughput:.3f}x "
        f"(target: equal or better, >= {EQUAL_THROUGHPUT}): {'met' if met else 'NOT met'}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.multiturn",
        description="Multi-turn chat over two workers under each routing policy.",
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    parser.add_argument(
        "--users", type=int, default=16, help="conversations (over the arrivals, or at once)"
    )
    parser.add_argument("--turns", type=int, default=8, help="turns per conversation")
    parser.add_argument("--system-words", type=int, default=150, help="shared system prompt")
    parser.add_argument("--user-words", type=int, default=50, help="words per user turn")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument(
        "--think-time",
        type=float,
        default=4.0,
        help="mean seconds a user pauses before each turn (exponential); 0: none",
    )
    parser.add_argument(
        "--arrival-rate",
        type=float,
        default=0.1,
        help="new conversations a second (Poisson, the same times under every policy); "
        "0: every user starts at once",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="the workers' vLLM --block-size (KV-cache block in tokens; prefix caching "
        "reuses whole blocks only); 0: the worker's default (32 on CPU, vLLM's 16 on GPU)",
    )
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if set(policies) - set(POLICIES) or not policies:
        raise SystemExit(f"--policies: choose from {', '.join(POLICIES)}")
    from worker.embedded_model import ensure_model

    ensure_model()
    started = datetime.now(UTC)
    run_dir = results_dir("multiturn", started)
    print(f"results and logs: {run_dir.relative_to(ROOT)}/", flush=True)
    engine = targets.Engine(args.enforce_eager, args.startup_timeout, block_size=args.block_size)
    results: list[PolicyResult] = []
    every_turn: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        addresses, metrics_urls = start_workers(stack, engine, run_dir, args.startup_timeout)
        for n, policy in enumerate(policies):
            with gateway(policy, addresses, run_dir) as url:
                if n == 0:  # the engines' first requests are slow: not counted
                    warm = argparse.Namespace(
                        **{**vars(args), "turns": 1, "arrival_rate": 0.0, "think_time": 0.0}
                    )
                    asyncio.run(run_policy(url, warm, "warm-up"))
                before = [prefix_counters(u) for u in metrics_urls]
                print(f"[{policy}] {args.users} users x {args.turns} turns", flush=True)
                turns, seconds = asyncio.run(run_policy(url, args, f"{policy} {started:%H%M%S}"))
                after = [prefix_counters(u) for u in metrics_urls]
            rates: list[float | None] = [
                (h1 - h0) / (q1 - q0) if q1 > q0 else None
                for (q0, h0), (q1, h1) in zip(before, after, strict=True)
            ]
            result = summarize(policy, turns, seconds, rates)
            results.append(result)
            every_turn[policy] = [asdict(t) for t in sorted(turns, key=lambda t: t.started_s)]
            print(format_table([result]).splitlines()[-1], flush=True)
    title = (
        f"{started:%Y-%m-%d %H:%M} UTC, 2 workers, vLLM {vllm_version()}, {targets.MODEL}, "
        f"{args.users} users x {args.turns} turns, system prompt {args.system_words} words, "
        f"user turns {args.user_words} words, {args.max_tokens} tokens per answer, "
        + (
            f"{args.arrival_rate:g} new conversations/s (Poisson)"
            if args.arrival_rate > 0
            else "all users at once"
        )
        + (f", {args.think_time:g} s mean think time" if args.think_time > 0 else "")
        + (f", block size {args.block_size}" if args.block_size else "")
    )
    document = {
        "date": started.isoformat(),
        "title": title,
        "parameters": vars(args),
        "results": [asdict(r) for r in results],
        "verdict": verdict(results),
        # Each turn (user, turn, worker, sent at, TTFT, ...), to tell a pile-up
        # on one worker from a stall of the whole machine.
        "turns": every_turn,
    }
    write_json_and_csv(run_dir, document, results)
    print()
    print(title)
    print(format_table(results))
    for r in results:
        by_turn = ", ".join("-" if x is None else f"{x:,.0f}" for x in r.mean_ttft_by_turn_ms)
        print(f"{r.policy} mean TTFT by turn (ms): {by_turn}")
        moved_ms = "-" if r.mean_ttft_moved_ms is None else f"{r.mean_ttft_moved_ms:,.0f}"
        load = "-" if r.mean_load_at_send is None else f"{r.mean_load_at_send:.1f}"
        print(
            f"{r.policy}: {r.moved_turns} turns moved to another worker (mean TTFT {moved_ms} ms); "
            f"mean turns running on the worker a turn was sent to: {load}"
        )
    line = verdict(results)
    if line:
        print(line)
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
