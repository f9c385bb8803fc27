"""The ceiling: vLLM's ``AsyncLLM`` driven in-process by the bench's closed-loop users.

No HTTP, no JSON, no second hop: each user calls ``AsyncLLM.generate`` with
the same prompt, greedy, exactly ``max_tokens`` tokens, and the stream of
``RequestOutput`` deltas gives TTFT and ITL as an SSE stream does for the
servers. No server can beat this with the same engine and cores.

``make bench`` runs it in a child process (so the engine's processes go with
it); by hand::

    python -m loadtest.inprocess --out stats.json --duration 10 --enforce-eager
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.closed_loop import Sample, run_closed_loop, summarize
from loadtest.report import write_json
from loadtest.targets import KV_CACHE_GIB, MODEL

TARGET = "vllm-inprocess"


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from worker.embedded_model import ensure_model

    engine_args = AsyncEngineArgs(
        model=args.model_dir or str(ensure_model()),
        served_model_name=[MODEL],
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        block_size=args.block_size or None,
    )
    started = time.monotonic()
    llm = AsyncLLM.from_engine_args(engine_args)
    print(f"[{TARGET}] engine ready in {time.monotonic() - started:.0f}s", flush=True)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    ids = itertools.count()

    async def send(sample: Sample) -> None:
        try:
            async for output in llm.generate(args.prompt, params, f"bench-{next(ids)}"):
                completion = output.outputs[0]
                if completion.text:
                    sample.token_times.append(time.perf_counter())
                sample.output_tokens += len(completion.token_ids)
        except Exception as exc:  # counted as an error, as an HTTP failure would be
            sample.error = type(exc).__name__
        sample.end = time.perf_counter()

    try:
        print(
            f"[{TARGET}] {args.users} users: {args.warmup:g}s warmup + {args.duration:g}s measured",
            flush=True,
        )
        run = await run_closed_loop(send, args.users, args.warmup, args.duration)
    finally:
        llm.shutdown()
    return asdict(summarize(TARGET, *run.window(), run.cpu_cores))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.inprocess", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="where to write the stats JSON")
    parser.add_argument("--users", type=int, default=40)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=10)
    parser.add_argument("--prompt", default="Hello World, what is your name dog?")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--block-size", type=int, default=0, help="0: vLLM's default")
    parser.add_argument("--model-dir", default=None, help="default: the embedded model")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    stats = asyncio.run(measure(args))
    write_json(args.out, stats)


if __name__ == "__main__":
    main()
