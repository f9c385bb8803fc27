"""Closed-loop load: N users, each sends a request, waits for its end, sends the next.

The same loop drives every bench target: HTTP servers through
:func:`http_completion` and vLLM's in-process engine (``loadtest.inprocess``).
After ``warmup`` seconds a window of ``duration`` seconds is measured:
requests that *end* inside it give requests/s and latencies; tokens that
*arrive* inside it give tokens/s. Requests still running when it closes are
cancelled.

One request is a :class:`Sample`: when it started and ended, when its first
and each later piece of text arrived (so TTFT and inter-token latency come
from the stream), and how many tokens it produced.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest import cpu_use
from loadtest.percentiles import mean, percentile


@dataclass
class Sample:
    """One request as the client saw it; times from ``time.perf_counter``."""

    start: float
    end: float
    output_tokens: int = 0
    # Arrival time of every stream event that carried text, in order.
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls(self) -> list[float]:
        """Gaps between successive text events (vLLM's benchmark definition of ITL)."""
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


@dataclass
class Stats:
    """What the bench table reports for one target; latencies in milliseconds."""

    target: str
    requests_per_s: float
    output_tokens_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    mean_ttft_ms: float | None
    mean_itl_ms: float | None
    ok: int
    errors: int
    measured_s: float
    error_kinds: dict[str, int] = field(default_factory=dict)
    # Mean cores each kind of process used in the window (loadtest.cpu_use).
    cpu_cores: dict[str, float] = field(default_factory=dict)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def summarize(
    target: str,
    samples: list[Sample],
    window_start: float,
    window_end: float,
    cpu_cores: dict[str, float] | None = None,
) -> Stats:
    """Throughput and latency inside the window ``[window_start, window_end]``.

    Requests and latencies are those of requests that *ended* in the window.
    Output tokens are those that *arrived* in it, from every request, also
    those that started before it or were still running at its end: with
    identical requests the users move in waves, and counting whole requests
    would make tokens/s depend on where the waves fall (a 128-token request
    takes longer than a short window).
    """
    measured_s = window_end - window_start
    ended = [s for s in samples if s.end and window_start <= s.end <= window_end]
    ok = [s for s in ended if s.error is None]
    errors = Counter(s.error for s in ended if s.error is not None)
    latencies = [s.end - s.start for s in ok]
    ttfts = [t for s in ok if (t := s.ttft) is not None]
    itls = [gap for s in ok for gap in s.itls]
    return Stats(
        target=target,
        requests_per_s=len(ok) / measured_s,
        output_tokens_per_s=tokens_in_window(samples, ok, window_start, window_end) / measured_s,
        p50_ms=_ms(percentile(latencies, 50)),
        p99_ms=_ms(percentile(latencies, 99)),
        mean_ttft_ms=_ms(mean(ttfts)),
        mean_itl_ms=_ms(mean(itls)),
        ok=len(ok),
        errors=sum(errors.values()),
        measured_s=measured_s,
        error_kinds={str(k): v for k, v in errors.items()},
        cpu_cores=cpu_cores or {},
    )


def tokens_in_window(
    samples: list[Sample], ok: list[Sample], window_start: float, window_end: float
) -> float:
    """Output tokens that arrived in the window (streams), else those of ``ok`` requests.

    A text event carries ``output_tokens / events`` tokens once the request's
    usage is known (usually one), and one token while it is still running.
    """
    if not any(s.token_times for s in samples):  # plain JSON responses: whole requests only
        return float(sum(s.output_tokens for s in ok))
    total = 0.0
    for sample in samples:
        if sample.error is not None or not sample.token_times:
            continue
        events = len(sample.token_times)
        per_event = sample.output_tokens / events if sample.end and sample.output_tokens else 1.0
        inside = sum(1 for t in sample.token_times if window_start <= t <= window_end)
        total += inside * per_event
    return total


@dataclass
class LoadRun:
    """What :func:`run_closed_loop` returns: every sample and the window's bounds
    (for :func:`summarize`), and the cores each kind of process used in the
    window (``loadtest.cpu_use``)."""

    samples: list[Sample]
    window_start: float
    window_end: float
    cpu_cores: dict[str, float] = field(default_factory=dict)

    def window(self) -> tuple[list[Sample], float, float]:
        """The arguments :func:`summarize` takes after the target's name."""
        return self.samples, self.window_start, self.window_end


async def run_closed_loop(
    send: Callable[[Sample], Awaitable[None]],
    users: int,
    warmup: float,
    duration: float,
) -> LoadRun:
    """``users`` loops of ``send`` for ``warmup + duration`` seconds.

    ``send`` fills in the :class:`Sample` it is given (``end`` last), so a
    request still running when the window closes keeps the tokens it got.
    Those requests are cancelled then (the server sees a client go away).
    """
    start = time.perf_counter()
    window_start = start + warmup
    deadline = window_start + duration
    samples: list[Sample] = []

    async def user() -> None:
        while (now := time.perf_counter()) < deadline:
            sample = Sample(start=now, end=0.0)
            samples.append(sample)
            await send(sample)

    tasks = [asyncio.create_task(user()) for _ in range(users)]
    await asyncio.wait(tasks, timeout=window_start - start)
    before = cpu_use.snapshot()
    await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    after = cpu_use.snapshot()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return LoadRun(samples, window_start, deadline, cpu_use.cores_by_kind(before, after))


def completion_payload(model: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    """The bench's request body: greedy, exactly ``max_tokens`` tokens, usage in the stream.

    ``ignore_eos`` makes every target generate the same number of tokens, so
    tokens/s compare like with like; greedy is what the baseline does best.
    """
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """The JSON of one ``data:`` line; None for other lines and for ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    parsed = json.loads(data)
    return parsed if isinstance(parsed, dict) else None


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a completions stream chunk carries (all choices)."""
    return "".join(str(c.get("text") or "") for c in chunk.get("choices") or ())


def usage_tokens(body: dict[str, Any]) -> int | None:
    usage = body.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return None


async def http_completion(
    client: httpx.AsyncClient, payload: dict[str, Any], sample: Sample
) -> None:
    """POST ``/v1/completions`` once into ``sample``; stream it when the payload says so."""
    try:
        if payload.get("stream"):
            await _stream(client, payload, sample)
        else:
            response = await client.post("/v1/completions", json=payload)
            if response.status_code != 200:
                sample.error = f"HTTP {response.status_code}"
            else:
                body = response.json()
                sample.output_tokens = usage_tokens(body) or 0
    except httpx.HTTPError as exc:
        sample.error = type(exc).__name__
    except (json.JSONDecodeError, ValueError) as exc:
        sample.error = f"bad body: {type(exc).__name__}"
    sample.end = time.perf_counter()


async def _stream(client: httpx.AsyncClient, payload: dict[str, Any], sample: Sample) -> None:
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            await response.aread()
            sample.error = f"HTTP {response.status_code}"
            return
        text_events = 0
        usage: int | None = None
        async for line in response.aiter_lines():
            chunk = parse_sse_line(line)
            if chunk is None:
                continue
            if chunk_text(chunk):
                sample.token_times.append(time.perf_counter())
                text_events += 1
            usage = usage_tokens(chunk) or usage
        # Usage is exact; counting text events undercounts when one carries several tokens.
        sample.output_tokens = usage if usage is not None else text_events
