"""Span extraction's cost: grammar build and per-token decode, with and without spans.

Two parts, for sources of 500 and 4,000 characters (``--sizes``):

1. **In process**, as vLLM's xgrammar backend does it: our schema -> EBNF
   build (``worker.json_spans``), xgrammar's compile with the embedded model's
   tokenizer (no cache), and the per-token mask time of a matcher walking a
   valid answer.
2. **Through ``llmgate serve``** (one worker, the embedded model,
   ``--enforce-eager``): the prefill of the request (time to first token of
   the same chat request with ``max_tokens`` 1 and no constraint), and, with
   and without ``x-span``, time to first token and the mean time per output
   token after it. Each request starts with a fresh nonce, so vLLM's prefix
   cache never turns a prefill into a hit.

Prints a table; writes ``results.json`` and the server log under
``loadtest/results/<UTC time>-spans/``.

    .venv/bin/python -m loadtest.spans
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx

from loadtest.procs import await_ready, launched, served_model
from loadtest.report import ROOT, results_dir, stamp, write_json
from shared.ports import free_port, free_port_range

STARTUP_TIMEOUT_S = 600.0
# Prose to take sources from: the manual's paragraphs (no code, no tables).
PROSE_PAGES = ("docs/index.md", "docs/getting-started.md", "docs/api.md", "docs/deploy.md")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "x-span": True, "minLength": 1},
        "claims": {
            "type": "array",
            "items": {"type": "string", "x-span": True, "minLength": 1},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["title", "claims"],
}


def source_text(size: int) -> str:
    """``size`` characters of the manual's prose (deterministic for one manual)."""
    lines, in_code = [], False
    prose = "\n".join((ROOT / page).read_text() for page in PROSE_PAGES)
    for line in prose.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line and line[0].isalpha():
            lines.append(line)
    text = "\n".join(lines)
    while len(text) < size:
        text += "\n" + text
    return text[:size]


def without_spans(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: without_spans(v) for k, v in schema.items() if k != "x-span"}
    if isinstance(schema, list):
        return [without_spans(v) for v in schema]
    return schema


def measure_grammar(size: int, repeats: int) -> dict[str, Any]:
    """Build and compile times, and the matcher's per-token mask time, in process."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from shared.embedded import default_model_dir
    from worker import json_spans

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
    source = source_text(size)
    builds, compiles = [], []
    compiled: Any = None
    grammar = ""
    for _ in range(repeats):
        started = time.perf_counter()
        grammar = json_spans.plan_schema(SCHEMA, source, "response_format").grammar or ""
        built = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        builds.append(built - started)
        compiles.append(time.perf_counter() - built)
    plain = compiler.compile_json_schema(json.dumps(without_spans(SCHEMA)), any_whitespace=False)
    # Spans within lines (xgrammar's plain JSON grammar and the tokenizer
    # disagree on some escapes, which is beside the point here).
    lines = [line for line in source.splitlines() if len(line) > 40]
    answer = json.dumps(
        {"title": lines[0][:30], "claims": [lines[1][:120], lines[2][-10:]]},
        ensure_ascii=False,
    )
    return {
        "source_chars": size,
        "grammar_rules": grammar.count("::="),
        "build_ms": 1000 * statistics.median(builds),
        "compile_ms": 1000 * statistics.median(compiles),
        "mask_ms_per_token_span": mask_ms(compiled, info, tokenizer, answer),
        "mask_ms_per_token_plain": mask_ms(plain, info, tokenizer, answer),
    }


def mask_ms(compiled: Any, info: Any, tokenizer: Any, answer: str) -> float:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    ids = tokenizer.encode(answer)
    started = time.perf_counter()
    for token in ids:
        matcher.fill_next_token_bitmask(bitmask)
        if not matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused {tokenizer.decode([token])!r} in {answer!r}")
    return 1000 * (time.perf_counter() - started) / len(ids)


async def timed_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, float]:
    """TTFT and mean inter-token time of one streaming chat request."""
    started = time.perf_counter()
    first = last = 0.0
    tokens = 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    return {
        "ttft_s": first - started,
        "per_token_ms": 1000 * (last - first) / max(tokens - 1, 1),
        "tokens": tokens,
    }


def chat_body(model: str, source: str, schema: dict[str, Any] | None, max_tokens: int) -> Any:
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "system", "content": f"[{uuid.uuid4().hex}] Extract the title and claims."},
            {"role": "user", "content": source},
        ],
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "extraction", "schema": schema},
        }
    return body


async def measure_engine(url: str, model: str, size: int, repeats: int) -> dict[str, Any]:
    source = source_text(size)
    runs: dict[str, list[dict[str, float]]] = {"prefill": [], "span": [], "plain": []}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for _ in range(repeats):
            runs["prefill"].append(await timed_stream(client, chat_body(model, source, None, 1)))
            runs["span"].append(await timed_stream(client, chat_body(model, source, SCHEMA, 64)))
            plain = chat_body(model, source, without_spans(SCHEMA), 64)
            runs["plain"].append(await timed_stream(client, plain))

    def median(kind: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[kind])

    return {
        "source_chars": size,
        "prefill_s": median("prefill", "ttft_s"),
        "ttft_s_span": median("span", "ttft_s"),
        "ttft_s_plain": median("plain", "ttft_s"),
        "per_token_ms_span": median("span", "per_token_ms"),
        "per_token_ms_plain": median("plain", "per_token_ms"),
        "tokens_span": median("span", "tokens"),
        "tokens_plain": median("plain", "tokens"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 4000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    started = datetime.now(UTC)
    run_dir = results_dir("spans", started)
    grammar = [measure_grammar(size, args.repeats) for size in args.sizes]
    port, base = free_port(), free_port_range(1)
    argv_serve = [
        *(sys.executable, "-m", "serve", "--port", str(port)),
        *("--worker-base-port", str(base), "--enforce-eager"),
    ]
    url = f"http://127.0.0.1:{port}"
    log_path = run_dir / "serve.log"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
    with launched("llmgate serve", argv_serve, log_path, env=env, cwd=ROOT) as proc:
        await_ready("llmgate serve", proc, log_path, f"{url}/ready", STARTUP_TIMEOUT_S)
        model = served_model(url)
        asyncio.run(measure_engine(url, model, 200, 1))  # warm-up
        engine = [asyncio.run(measure_engine(url, model, s, args.repeats)) for s in args.sizes]
    report = {
        "date": stamp(started),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "parameters": vars(args),
        "grammar": grammar,
        "engine": engine,
    }
    write_json(run_dir / "results.json", report)
    print(
        f"{'chars':>6} {'rules':>6} {'build ms':>9} {'compile ms':>11} "
        f"{'mask ms/tok span/plain':>23} {'prefill s':>10} {'TTFT s span/plain':>18} "
        f"{'decode ms/tok span/plain':>25}"
    )
    for g, e in zip(grammar, engine, strict=True):
        print(
            f"{g['source_chars']:>6} {g['grammar_rules']:>6} {g['build_ms']:>9.1f} "
            f"{g['compile_ms']:>11.1f} "
            f"{g['mask_ms_per_token_span']:>11.3f}/{g['mask_ms_per_token_plain']:<11.3f} "
            f"{e['prefill_s']:>10.3f} {e['ttft_s_span']:>8.3f}/{e['ttft_s_plain']:<9.3f} "
            f"{e['per_token_ms_span']:>12.1f}/{e['per_token_ms_plain']:<12.1f}"
        )
    print(f"results: {run_dir}")


if __name__ == "__main__":
    main()
