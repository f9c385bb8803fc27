"""The simulated users of the multi-turn bench (``loadtest.multiturn``): their
texts, when their conversations start, and each conversation's turns.

Every text starts with the run's tag, so nothing one policy's run put in a
worker's prefix cache helps the next; the texts, arrival times and pauses
are the same under every policy (fixed seeds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from loadtest import targets

WORDS = (
    "river mountain lantern copper orbit meadow harbor signal velvet quarry "
    "falcon ember glacier thunder saddle marble cactus willow beacon prism "
    "anchor canyon pepper violet tunnel orchard compass blossom timber "
    "lagoon nickel parade summit walnut zephyr ribbon granite tulip cobalt"
).split()


@dataclass
class Turn:
    user: int
    turn: int
    ttft_s: float | None
    latency_s: float
    output_tokens: int
    error: str | None = None
    # The worker that answered, and when the turn was sent (seconds into the run).
    worker: str = ""
    started_s: float = 0.0


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def system_prompt(tag: str, words: int) -> str:
    rng = random.Random(0)
    return (
        f"[{tag}] You are a patient assistant for a game of word associations. "
        "Here are the rules and the vocabulary of the game: " + text(rng, words)
    )


def user_message(tag: str, user: int, turn: int, words: int) -> str:
    rng = random.Random(f"{user}-{turn}")
    return f"[{tag}] Player {user}, round {turn}: " + text(rng, words)


def arrival_offsets(users: int, rate: float) -> list[float]:
    """When each conversation starts, in seconds from the run's start.

    0 for all with no rate (everyone at once); else a Poisson process of
    ``rate`` a second, the same for every policy (a fixed seed).
    """
    if rate <= 0:
        return [0.0] * users
    rng = random.Random("arrivals")
    offsets, at = [], 0.0
    for _ in range(users):
        offsets.append(at)
        at += rng.expovariate(rate)
    return offsets


async def conversation(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    tag: str,
    user: int,
    start_at: float,
    run_start: float,
) -> list[Turn]:
    """One user's turns, from ``start_at`` seconds after ``run_start`` on."""
    await asyncio.sleep(start_at)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(tag, args.system_words)}
    ]
    turns: list[Turn] = []
    # The same pauses under every policy: a user reads, then types.
    thinking = random.Random(f"think-{user}")
    for turn in range(1, args.turns + 1):
        if args.think_time > 0:
            await asyncio.sleep(thinking.expovariate(1 / args.think_time))
        messages.append({"role": "user", "content": user_message(tag, user, turn, args.user_words)})
        body = {
            "model": targets.MODEL,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first: float | None = None
        answer: list[str] = []
        tokens = 0
        error = None
        worker = ""
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}"
                    await response.aread()
                else:
                    worker = response.headers.get("x-llmgate-worker", "?")
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        for choice in chunk.get("choices", []):
                            content = choice.get("delta", {}).get("content")
                            if content:
                                first = first or time.perf_counter()
                                answer.append(content)
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            error = type(exc).__name__
        end = time.perf_counter()
        ttft = first - start if first is not None else None
        turns.append(Turn(user, turn, ttft, end - start, tokens, error, worker, start - run_start))
        if error:
            break
        messages.append({"role": "assistant", "content": "".join(answer)})
    return turns


async def run_policy(url: str, args: argparse.Namespace, tag: str) -> tuple[list[Turn], float]:
    limits = httpx.Limits(max_connections=args.users, max_keepalive_connections=args.users)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        offsets = arrival_offsets(args.users, args.arrival_rate)
        started = time.perf_counter()
        done = await asyncio.gather(
            *(
                conversation(client, args, tag, user, offsets[user], started)
                for user in range(args.users)
            )
        )
        seconds = time.perf_counter() - started
    return [t for user_turns in done for t in user_turns], seconds
