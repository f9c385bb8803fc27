"""Shared documents over two workers: which routing policy computes each document once?

``make bench ARGS="--scenario rag"`` (or ``python -m loadtest.rag``).
Two real workers (the embedded model, each on its own core slice, each with
1 GiB of KV cache as ``llmgate serve`` gives it, publishing KV cache events)
start once. The workload is retrieval-augmented chat: ``--documents``
documents of ``--document-words`` (600) words, each the system prompt of
``--questions`` (6) different questions, asked in one shuffled order (the
same under every policy) by ``--clients`` (4) closed-loop clients, each
answered with ``--max-tokens`` (8) tokens. By default the documents are as
many as fill 1.5 times one engine's KV cache (read from vLLM's
``vllm:cache_config_info``): more than one engine holds, less than two.

Each policy of ``--policies`` (round-robin, least-load, prefix, kv) runs
behind one gateway, and ``--gateways 2`` runs each again behind two gateway
processes, the clients taking turns between them (``kv@2``). Every text of
a run starts with the run's tag, so nothing an earlier run cached helps.

Reported per run: the prompt tokens the engines computed (vLLM's
``vllm:prefix_cache_queries`` minus ``vllm:prefix_cache_hits``, both
workers), against round-robin's and against the floor (each document's
cacheable blocks computed once, every other prompt token each time); each
worker's share of the requests; errors; mean and p99 latency. The targets
read: ``kv`` at most 0.7x round-robin's prompt tokens, every request
answered, each worker at least 30% of the requests, behind one gateway and
two. Results go to ``loadtest/results/<UTC time>-rag/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest import targets
from loadtest.conversations import text
from loadtest.machine import vllm_version
from loadtest.multiturn import gateway, prefix_counters, start_workers
from loadtest.percentiles import mean, percentile
from loadtest.report import ROOT, markdown_table, ms, results_dir, write_json_and_csv

POLICIES = ("round-robin", "least-load", "prefix", "kv")
TARGET_RATIO = 0.7
TARGET_SHARE = 0.3
# Documents fill this many times one engine's KV cache (--documents 0).
CACHE_FILL = 1.5


@dataclass
class Answer:
    document: int
    question: int
    latency_s: float
    prompt_tokens: int = 0
    worker: str = ""
    error: str | None = None


@dataclass
class RunResult:
    run: str
    requests: int
    errors: int
    seconds: float
    computed_prompt_tokens: float
    prompt_tokens: int
    floor_tokens: int
    against_floor: float
    against_round_robin: float | None
    mean_latency_ms: float | None
    p99_latency_ms: float | None
    requests_per_worker: dict[str, int] = field(default_factory=dict)
    least_share: float = 0.0


def cache_tokens(metrics_url: str) -> tuple[int, int]:
    """(KV cache tokens, block size) of one engine, from vLLM's ``cache_config_info``."""
    page = httpx.get(metrics_url, timeout=10).text
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                labels = sample.labels
                blocks = int(labels.get("num_gpu_blocks") or labels.get("num_cpu_blocks") or 0)
                size = int(labels["block_size"])
                return blocks * size, size
    raise RuntimeError(f"no vllm:cache_config_info at {metrics_url}")


def document(tag: str, number: int, words: int) -> str:
    rng = random.Random(f"document-{number}")
    return f"[{tag}] Document {number}. Answer from this text only. " + text(rng, words)


def question(number: int, asked: int) -> str:
    rng = random.Random(f"question-{number}-{asked}")
    return f"Question {asked} on document {number}: what follows {text(rng, 3)}"


def messages(tag: str, number: int, asked: int, words: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": document(tag, number, words)},
        {"role": "user", "content": question(number, asked)},
    ]


def order(documents: int, questions: int) -> list[tuple[int, int]]:
    """Every (document, question), in one seeded shuffle: the same under every policy."""
    pairs = [(d, q) for d in range(documents) for q in range(questions)]
    random.Random("rag-order").shuffle(pairs)
    return pairs


def prompt_ids(tokenizer: Any, chat: list[dict[str, str]]) -> list[int]:
    """A chat's prompt token ids, as vLLM makes them (the template, then no special tokens)."""
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def shared_tokens(tokenizer: Any, tag: str, number: int, words: int, block: int) -> int:
    """Tokens of a document's prompts an engine can reuse: their common start, in
    whole blocks (vLLM caches full blocks only)."""
    prompts = [prompt_ids(tokenizer, messages(tag, number, asked, words)) for asked in (0, 1)]
    common = 0
    for a, b in zip(*prompts, strict=False):
        if a != b:
            break
        common += 1
    return common // block * block


async def ask_all(
    urls: list[str], args: argparse.Namespace, tag: str
) -> tuple[list[Answer], float]:
    """Every question, by ``--clients`` closed-loop clients (client i uses urls[i % n])."""
    pending = list(order(args.documents, args.questions))
    pending.reverse()
    answers: list[Answer] = []

    async def client(i: int) -> None:
        async with httpx.AsyncClient(base_url=urls[i % len(urls)], timeout=900) as http:
            while pending:
                number, asked = pending.pop()
                body = {
                    "model": targets.MODEL,
                    "messages": messages(tag, number, asked, args.document_words),
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                }
                start = time.perf_counter()
                answer = Answer(number, asked, 0.0)
                try:
                    response = await http.post("/v1/chat/completions", json=body)
                    if response.status_code == 200:
                        answer.prompt_tokens = response.json()["usage"]["prompt_tokens"]
                        answer.worker = response.headers.get("x-llmgate-worker", "?")
                    else:
                        answer.error = f"HTTP {response.status_code}"
                except httpx.HTTPError as exc:
                    answer.error = type(exc).__name__
                answer.latency_s = time.perf_counter() - start
                answers.append(answer)

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(args.clients)))
    return answers, time.perf_counter() - started


def summarize(
    run: str, answers: list[Answer], seconds: float, computed: float, shared: dict[int, int]
) -> RunResult:
    ok = [a for a in answers if a.error is None]
    per_worker: dict[str, int] = {}
    for a in ok:
        per_worker[a.worker] = per_worker.get(a.worker, 0) + 1
    prompt_tokens = sum(a.prompt_tokens for a in ok)
    asked: dict[int, int] = {}
    for a in ok:
        asked[a.document] = asked.get(a.document, 0) + 1
    # Each document's reusable blocks computed once; the rest of every prompt each time.
    floor = prompt_tokens - sum((n - 1) * shared[d] for d, n in asked.items())
    latencies = [a.latency_s * 1000 for a in ok]
    return RunResult(
        run=run,
        requests=len(ok),
        errors=len(answers) - len(ok),
        seconds=seconds,
        computed_prompt_tokens=computed,
        prompt_tokens=prompt_tokens,
        floor_tokens=floor,
        against_floor=computed / floor if floor else math.nan,
        against_round_robin=None,
        mean_latency_ms=mean(latencies),
        p99_latency_ms=percentile(latencies, 99),
        requests_per_worker=per_worker,
        least_share=min(per_worker.values(), default=0) / len(ok) if len(per_worker) > 1 else 0.0,
    )


TABLE_HEADER = (
    "run",
    "prompt tokens computed",
    "x round-robin",
    "x floor",
    "requests per worker",
    "least share",
    "errors",
    "mean latency ms",
    "p99 latency ms",
)


def format_table(results: list[RunResult]) -> str:
    def row(r: RunResult) -> list[str]:
        spread = ", ".join(str(n) for _, n in sorted(r.requests_per_worker.items()))
        ratio = "-" if r.against_round_robin is None else f"{r.against_round_robin:.2f}"
        return [
            r.run,
            f"{r.computed_prompt_tokens:,.0f}",
            ratio,
            f"{r.against_floor:.2f}",
            spread,
            f"{r.least_share:.0%}",
            str(r.errors),
            ms(r.mean_latency_ms),
            ms(r.p99_latency_ms),
        ]

    return markdown_table(TABLE_HEADER, map(row, results))


def verdicts(results: list[RunResult]) -> list[str]:
    lines = []
    for r in results:
        if not r.run.startswith("kv") or r.against_round_robin is None:
            continue
        met = (
            r.against_round_robin <= TARGET_RATIO
            and r.errors == 0
            and r.least_share >= TARGET_SHARE
        )
        lines.append(
            f"{r.run}: {r.against_round_robin:.2f}x round-robin's prompt tokens (target <= "
            f"{TARGET_RATIO}), {r.errors} errors, least worker share {r.least_share:.0%} "
            f"(target >= {TARGET_SHARE:.0%}): {'met' if met else 'NOT met'}"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.rag",
        description="Shared documents over two workers under each routing policy.",
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    parser.add_argument(
        "--gateways", type=int, default=2, help="also run each policy behind this many (1: no)"
    )
    parser.add_argument(
        "--documents",
        type=int,
        default=0,
        help=f"documents; 0: as many as fill {CACHE_FILL}x one engine's KV cache",
    )
    parser.add_argument("--document-words", type=int, default=600)
    parser.add_argument("--questions", type=int, default=6, help="questions per document")
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per answer")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if set(policies) - set(POLICIES) or not policies:
        raise SystemExit(f"--policies: choose from {', '.join(POLICIES)}")
    if args.gateways < 1 or args.questions < 2 or args.clients < 1:
        raise SystemExit("--gateways and --clients must be >= 1, --questions >= 2")
    from transformers import AutoTokenizer

    from worker.embedded_model import ensure_model

    ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(str(targets.Engine(True, 0).model_path))
    started = datetime.now(UTC)
    run_dir = results_dir("rag", started)
    print(f"results and logs: {run_dir.relative_to(ROOT)}/", flush=True)
    engine = targets.Engine(args.enforce_eager, args.startup_timeout)
    runs = [(p, 1) for p in policies]
    if args.gateways > 1:
        runs += [(p, args.gateways) for p in policies]
    results: list[RunResult] = []
    every_answer: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        addresses, metrics_urls = start_workers(stack, engine, run_dir, args.startup_timeout)
        capacity, block = cache_tokens(metrics_urls[0])
        document_tokens = len(prompt_ids(tokenizer, messages("size", 0, 0, args.document_words)))
        if not args.documents:
            args.documents = math.ceil(CACHE_FILL * capacity / document_tokens)
        print(
            f"one engine's KV cache: {capacity:,} tokens ({block}-token blocks); "
            f"{args.documents} documents of about {document_tokens:,} tokens: "
            f"{args.documents * document_tokens / capacity:.2f}x one cache",
            flush=True,
        )
        for n, (policy, gateways) in enumerate(runs):
            name = policy if gateways == 1 else f"{policy}@{gateways}"
            tag = f"{name} {started:%H%M%S}"
            shared = {
                d: shared_tokens(tokenizer, tag, d, args.document_words, block)
                for d in range(args.documents)
            }
            with contextlib.ExitStack() as fronts:
                urls = [
                    fronts.enter_context(gateway(policy, addresses, run_dir, f"{name}-{g}"))
                    for g in range(gateways)
                ]
                if n == 0:  # the engines' first requests are slow: not counted
                    warm = argparse.Namespace(**{**vars(args), "documents": 2, "questions": 2})
                    asyncio.run(ask_all(urls, warm, "warm-up"))
                before = [prefix_counters(u) for u in metrics_urls]
                print(f"[{name}] {args.documents * args.questions} questions", flush=True)
                answers, seconds = asyncio.run(ask_all(urls, args, tag))
                after = [prefix_counters(u) for u in metrics_urls]
            computed = sum(
                (q1 - q0) - (h1 - h0) for (q0, h0), (q1, h1) in zip(before, after, strict=True)
            )
            result = summarize(name, answers, seconds, computed, shared)
            results.append(result)
            every_answer[name] = [asdict(a) for a in answers]
            print(format_table([result]).splitlines()[-1], flush=True)
    for r in results:
        base = next(
            (
                b
                for b in results
                if b.run.split("@")[0] == "round-robin" and ("@" in b.run) == ("@" in r.run)
            ),
            None,
        )
        if base is not None and base.computed_prompt_tokens:
            r.against_round_robin = r.computed_prompt_tokens / base.computed_prompt_tokens
    title = (
        f"{started:%Y-%m-%d %H:%M} UTC, 2 workers, vLLM {vllm_version()}, {targets.MODEL}, "
        f"KV cache {capacity:,} tokens each, {args.documents} documents of "
        f"{document_tokens:,} tokens x {args.questions} questions, {args.clients} clients, "
        f"{args.max_tokens} tokens per answer"
    )
    document_json = {
        "date": started.isoformat(),
        "title": title,
        "parameters": vars(args),
        "cache_tokens": capacity,
        "block_size": block,
        "results": [asdict(r) for r in results],
        "verdicts": verdicts(results),
        "answers": every_answer,
    }
    write_json_and_csv(run_dir, document_json, results)
    print()
    print(title)
    print(format_table(results))
    for line in verdicts(results):
        print(line)
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
