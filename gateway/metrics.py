"""The gateway's Prometheus metrics (``/metrics``), safe with many gateway processes.

With ``--processes N`` the gateway sets ``PROMETHEUS_MULTIPROC_DIR`` before
its processes start, prometheus_client writes each process's values there,
and ``/metrics`` aggregates them: counters and histograms add up, in-flight
and queue gauges are summed over live processes, and what workers report
about themselves is the most recent value any process saw.

Names follow Prometheus conventions (``_total`` counters, ``_seconds``
histograms, base units) under the ``llmgate_`` prefix.

The request path moves counters and gauges with :func:`add`: a sum in a
plain dict, which :func:`flush` hands to prometheus_client (its lock and
checks cost several times a dict update, a dozen times a request). The app
flushes every second (:func:`flush_every`), at shutdown, and before each
``/metrics`` answer, so a scrape of this process is exact and one of
another process is at most a second behind.
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from shared.protocol import Usage

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Label for requests naming a model no worker has served: clients choose the
# name, and each new one would be a new series that lives forever.
UNKNOWN_MODEL = "unknown"

M = TypeVar("M", Counter, Gauge, Histogram)

# Seconds; LLM requests range from milliseconds (a cached short answer) to minutes.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TOKEN_GAP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1,
    2.5,
    5,
)

REQUESTS = Counter(
    "llmgate_requests",
    "Finished HTTP requests by model, route and status.",
    ["model", "route", "status"],
)
E2E_LATENCY = Histogram(
    "llmgate_request_duration_seconds",
    "Time from the request's arrival to its last byte.",
    ["model", "route"],
    buckets=_LATENCY_BUCKETS,
)
TTFT = Histogram(
    "llmgate_time_to_first_token_seconds",
    "Streaming: time from arrival to the first token sent.",
    ["model", "route"],
    buckets=_LATENCY_BUCKETS,
)
ITL = Histogram(
    "llmgate_inter_token_latency_seconds",
    "Streaming: time between successive chunks of one response.",
    ["model"],
    buckets=_TOKEN_GAP_BUCKETS,
)
PROMPT_TOKENS = Counter("llmgate_prompt_tokens", "Prompt tokens of finished requests.", ["model"])
GENERATION_TOKENS = Counter(
    "llmgate_generation_tokens", "Generated tokens of finished requests.", ["model"]
)
# Per API key (its name from the keys file, or "-" with no keys configured:
# a bounded set, unlike anything a client sends).
KEY_REQUESTS = Counter(
    "llmgate_key_requests",
    "Finished requests by API key and status.",
    ["key", "status"],
)
KEY_TOKENS = Counter(
    "llmgate_key_tokens",
    "Tokens of finished requests by API key, as their usage said: prompt and completion "
    "(response cache hits included), and cached (those of them answered from the cache).",
    ["key", "type"],
)
IN_FLIGHT = Gauge(
    "llmgate_requests_in_flight",
    "Requests sent to a worker, not finished.",
    multiprocess_mode="livesum",
)
QUEUE_DEPTH = Gauge(
    "llmgate_queue_depth", "Requests waiting for a free worker slot.", multiprocess_mode="livesum"
)
RETRIES = Counter("llmgate_retries", "Requests re-sent to another worker, by reason.", ["reason"])
MIGRATIONS = Counter(
    "llmgate_migrations",
    "Streams moved to another worker mid-answer, by reason (worker_lost, worker_draining, "
    "gateway_silent, worker_refused).",
    ["reason"],
)
MIGRATED_TOKENS = Counter(
    "llmgate_migrated_tokens",
    "Tokens of moved streams' answers handed to the next worker, which computes "
    "them again as part of its prompt.",
)
REJECTED = Counter(
    "llmgate_rejected",
    "Requests refused before reaching a worker, by reason "
    "(queue_full and queue_timeout are 429s, no_worker is 503).",
    ["reason"],
)

# Pools (--config): which pool took a request, and why.
POOL_IN_FLIGHT = Gauge(
    "llmgate_pool_in_flight",
    "Requests sent to the pool's workers, not finished (pool: its name, or the model's).",
    ["pool"],
    multiprocess_mode="livesum",
)
POOL_QUEUE_DEPTH = Gauge(
    "llmgate_pool_queue_depth",
    "Requests waiting for a free slot in the pool (their home tier).",
    ["pool"],
    multiprocess_mode="livesum",
)
SPILLOVER = Counter(
    "llmgate_spillover",
    "Requests a full pool passed to a later tier.",
    ["from_pool", "to_pool"],
)
AUTO_ROUTES = Counter(
    "llmgate_auto_route",
    "Requests for the auto model, by the rule that matched and the pool it chose.",
    ["rule", "pool"],
)
CASCADE = Counter(
    "llmgate_cascade",
    "Cascaded requests: accepted (the default model's answer kept) or escalated.",
    ["outcome"],
)

# The response cache (--cache).
CACHE_REQUESTS = Counter(
    "llmgate_cache_requests",
    "Requests by what the response cache did: hit, miss (computed, then stored if it "
    "finished), bypass (not cacheable, or Cache-Control: no-store).",
    ["result"],
)
CACHE_BYTES = Gauge(
    "llmgate_cache_bytes",
    "Bytes of responses in the memory cache (the Redis backend's size is Redis's own INFO).",
    multiprocess_mode="livesum",
)
CACHE_ERRORS = Counter(
    "llmgate_cache_errors",
    "Cache backend operations that failed (Redis unreachable): the request is served uncached.",
    ["operation"],
)

# Batch jobs (gateway.batch): each line counted by the process that ran it.
BATCH_LINES = Counter(
    "llmgate_batch_lines",
    "Batch lines finished, by status: completed, failed (an error answer), "
    "cancelled or expired (never run).",
    ["status"],
)
# Every status shows from the start, at 0 (Prometheus's advice for known label
# values): a process that has run no line says 0, not nothing.
for _status in ("completed", "failed", "cancelled", "expired"):
    BATCH_LINES.labels(_status)
BATCH_JOBS = Gauge(
    "llmgate_batch_jobs",
    "Batch jobs in the state store, by status (validating, in_progress, completed, ...).",
    ["status"],
    multiprocess_mode="livemax",
)

WORKER_HEALTHY = Gauge(
    "llmgate_worker_healthy",
    "1 while the worker is healthy (heard from within --heartbeat-timeout, link up), else 0.",
    ["worker"],
    multiprocess_mode="mostrecent",
)
WORKER_STALLS = Counter(
    "llmgate_worker_stalls",
    "Times the worker fell silent past --heartbeat-timeout with requests there that waited "
    "for it (--stall-timeout: streams under way, or requests no other worker could take), "
    "by how that ended: resumed (it spoke again and they carried on) or lost (they ended "
    "with an error).",
    ["worker", "outcome"],
)
WORKER_RUNNING = Gauge(
    "llmgate_worker_requests_running",
    "Requests the worker's engine is running, as last reported.",
    ["worker"],
    multiprocess_mode="mostrecent",
)
WORKER_WAITING = Gauge(
    "llmgate_worker_requests_waiting",
    "Requests waiting in the worker's engine, as last reported.",
    ["worker"],
    multiprocess_mode="mostrecent",
)
WORKER_KV_USAGE = Gauge(
    "llmgate_worker_kv_cache_usage_ratio",
    "The worker's KV-cache use (0-1), as last reported.",
    ["worker"],
    multiprocess_mode="mostrecent",
)
KV_INDEX_BLOCKS = Gauge(
    "llmgate_kv_index_blocks",
    "Cache blocks the worker's engine holds, as its KV cache events told this process.",
    ["worker"],
    multiprocess_mode="mostrecent",
)
KV_EVENTS_GAPS = Counter(
    "llmgate_kv_events_gaps",
    "Times batches of the worker's KV cache events were missed (a sequence gap).",
    ["worker"],
)
WORKER_IN_FLIGHT = Gauge(
    "llmgate_worker_in_flight",
    "Requests this gateway has in flight on the worker.",
    ["worker"],
    multiprocess_mode="livesum",
)


@functools.lru_cache(maxsize=4096)
def child(metric: M, *labels: str) -> M:
    """``metric.labels(*labels)``, looked up once (prometheus_client's lookup
    takes a lock and rebuilds its key on every call, several times a request)."""
    return metric.labels(*labels)


# Counter and gauge moves not yet written to prometheus_client, by series.
_pending: dict[Counter | Gauge, float] = {}


def add(series: Counter | Gauge, amount: float = 1.0) -> None:
    """Move a counter (``amount`` >= 0) or a gauge (either way) by ``amount``, at
    the next :func:`flush`. ``series``: a metric without labels or a child."""
    _pending[series] = _pending.get(series, 0.0) + amount


# Finished requests not yet written, by (model, route, status, key): requests,
# the engine's prompt and generated tokens, and the key's prompt, completion
# and cached tokens.
_finished: dict[tuple[str, str, str, str], list[int]] = {}


def finished(
    model: str, route: str, status: str, key: str, usage: Usage | None, cached: bool = False
) -> None:
    """Count a finished request (``llmgate_requests_total``, the key's
    requests and tokens, the engine's tokens) at the next :func:`flush`.
    ``key``: its key's name; ``usage``: its tokens, if any; ``cached``: a
    response cache answered it, so the engine computed none."""
    row = _finished.get((model, route, status, key))
    if row is None:
        row = _finished[model, route, status, key] = [0, 0, 0, 0, 0, 0]
    row[0] += 1
    if usage is None:
        return
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    row[3] += prompt
    row[4] += completion
    if cached:
        row[5] += prompt + completion
    else:
        row[1] += prompt
        row[2] += completion


def flush() -> None:
    """Write what :func:`add` and :func:`finished` summed to prometheus_client."""
    global _pending, _finished
    pending, _pending = _pending, {}
    for series, amount in pending.items():
        if amount:
            series.inc(amount)
    rows, _finished = _finished, {}
    for (model, route, status, key), row in rows.items():
        requests, prompt, generated, key_prompt, key_completion, key_cached = row
        child(REQUESTS, model, route, status).inc(requests)
        child(KEY_REQUESTS, key, status).inc(requests)
        if prompt or generated:
            child(PROMPT_TOKENS, model).inc(prompt)
            child(GENERATION_TOKENS, model).inc(generated)
        if key_prompt or key_completion:
            child(KEY_TOKENS, key, "prompt").inc(key_prompt)
            child(KEY_TOKENS, key, "completion").inc(key_completion)
        if key_cached:
            child(KEY_TOKENS, key, "cached").inc(key_cached)


async def flush_every(seconds: float) -> None:
    """Flush every ``seconds``, until cancelled (then once more)."""
    try:
        while True:
            await asyncio.sleep(seconds)
            flush()
    finally:
        flush()


def render() -> tuple[bytes, str]:
    """The exposition text and its content type (after a :func:`flush`)."""
    flush()
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def mark_process_dead(pid: int) -> None:
    """Drop a finished gateway process's live gauges (multiprocess mode)."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
