"""The ``soak`` scenario of ``make loadtest``: hours of steady mixed load, memory watched.

``--soak-users`` closed-loop users (16), each sending in turn, by its number,
one of ``KINDS``: a whole completion, a streamed completion, a whole chat, a
streamed chat, or a streamed chat it leaves after the first chunk (a client
gone mid-stream: the gateway must abort it and keep nothing of it). One more
user sends with a key limited to ``LIMITED_RPM`` requests a minute, one
request a second, so about half of its requests get 429. The gateway started
for the run gets a keys file with both keys (``LLMGATE_API_KEYS_FILE``).

With ``--soak-beside-vllm`` a ``vllm serve`` of the same model runs beside it
and gets the same users (not the limited one: it has no keys), so growth of
an engine can be told apart: vLLM's own, or ours.

Every ``--sample-every`` seconds the RSS and open file descriptors of each
process are recorded (``soak_samples.csv``): the gateway, the worker (our
loop and vLLM's front end), vLLM's engine core and model runner, and ``vllm
serve``'s. The report gives each one's start, end and least-squares slope
over the second half (for a two-hour soak: the second hour), after start-up
allocations are done.
"""

from __future__ import annotations

import asyncio
import csv
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from loadtest.capacity import (
    ProcessSample,
    process_family,
    sample,
    server_processes,
    slope_mb_per_hour,
    total,
)

KINDS = ("completion", "completion-stream", "chat", "chat-stream", "chat-left")
TOKENS = 16
USERS_KEY = "sk-llmgate-soak-users"
LIMITED_KEY = "sk-llmgate-soak-limited"
LIMITED_RPM = 30


def keys_file(directory: Path) -> Path:
    """The gateway's keys: the users' (no limits) and the limited user's."""
    path = directory / "keys.yaml"
    path.write_text(
        "keys:\n"
        f"  - name: soak\n    key: {USERS_KEY}\n"
        f"  - name: limited\n    key: {LIMITED_KEY}\n    requests_per_minute: {LIMITED_RPM}\n"
    )
    return path


@dataclass
class Outcomes:
    """Per kind of request: how many ended as they should, and why the others did not."""

    ok: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    # The limited user's answers by status (200 and 429 expected).
    limited: Counter[int] = field(default_factory=Counter)


def body_of(kind: str, model: str, user: int, turn: int) -> tuple[str, dict[str, object]]:
    text = f"User {user} turn {turn}: tell me a story."
    body: dict[str, object] = {"model": model, "max_tokens": TOKENS}
    if kind.startswith("chat"):
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
    else:
        path = "/v1/completions"
        body["prompt"] = text
    if kind.endswith(("-stream", "-left")):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return path, body


async def one_request(
    client: httpx.AsyncClient, kind: str, path: str, body: dict[str, object]
) -> str:
    """Send one request of ``kind``; "" if it ended as it should, else why not."""
    if not body.get("stream"):
        response = await client.post(path, json=body)
        return "" if response.status_code == 200 else f"status {response.status_code}"
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return f"status {response.status_code}"
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return ""
            if '"error"' in line and "error" in json.loads(line[6:]):
                return "error event"
            if kind == "chat-left":
                return ""  # leaving: closing the response drops the connection mid-stream
    return "no [DONE]"


async def users(
    url: str, model: str, count: int, stop_at: float, key: str | None, outcomes: Outcomes
) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def user(client: httpx.AsyncClient, i: int) -> None:
        turn = 0
        while time.monotonic() < stop_at:
            turn += 1
            kind = KINDS[(i + turn) % len(KINDS)]
            path, body = body_of(kind, model, i, turn)
            try:
                why = await one_request(client, kind, path, body)
            except httpx.HTTPError as exc:
                why = type(exc).__name__
            if why:
                outcomes.failed[f"{kind}: {why[:60]}"] += 1
            else:
                outcomes.ok[kind] += 1

    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers) as client:
        await asyncio.gather(*(user(client, i) for i in range(count)))


async def limited_user(url: str, model: str, stop_at: float, outcomes: Outcomes) -> None:
    """One request a second with the limited key: about half over its limit."""
    headers = {"Authorization": f"Bearer {LIMITED_KEY}"}
    body = {"model": model, "prompt": "Limited:", "max_tokens": 4}
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers) as client:
        while time.monotonic() < stop_at:
            started = time.monotonic()
            try:
                outcomes.limited[(await client.post("/v1/completions", json=body)).status_code] += 1
            except httpx.HTTPError:
                outcomes.limited[0] += 1
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))


def vllm_pid_of(url: str) -> int | None:
    """The pid of the ``vllm serve`` (its OpenAI server) on this machine listening at ``url``."""
    port = url.rstrip("/").rsplit(":", 1)[-1]
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in cmdline and "--port" in cmdline:
            if cmdline[cmdline.index("--port") + 1] == port:
                return int(proc.pid)
    return None


def server_roles(server_pid: int | None, vllm_pid: int | None) -> dict[str, list[psutil.Process]]:
    """``llmgate serve``'s gateway and worker processes (and ``vllm serve``'s), by
    label, vLLM's engine processes apart."""
    roles = server_processes(server_pid, split_engine=True)
    if vllm_pid is not None:
        roles |= process_family("vllm serve", psutil.Process(vllm_pid), split_engine=True)
    return roles


def figures(samples: list[ProcessSample], label: str) -> dict[str, object]:
    times = sorted({s.at_s for s in samples if s.role == label})
    first, last = total(samples, label, times[0]), total(samples, label, times[-1])
    second_half = [(t, total(samples, label, t)[0]) for t in times if t >= times[-1] / 2]
    slope = slope_mb_per_hour(second_half)
    return {
        "rss_mb_start": round(first[0], 1),
        "rss_mb_end": round(last[0], 1),
        "rss_slope_mb_per_hour_second_half": round(slope, 2) if slope is not None else None,
        "fds_start": first[1],
        "fds_end": last[1],
    }


async def soak(
    url: str,
    model: str,
    count: int,
    duration: float,
    every: float,
    run_dir: Path,
    server_pid: int | None = None,
    keyed: bool = False,
    beside: str | None = None,
    beside_pid: int | None = None,
) -> dict[str, object]:
    """``count`` users (and with ``keyed``, the limited one) on ``url``, and as many
    on ``beside`` (a ``vllm serve``) if given, for ``duration`` s; memory sampled."""
    roles = server_roles(server_pid, beside_pid)
    ours, theirs = Outcomes(), Outcomes()
    samples: list[ProcessSample] = []
    started = time.monotonic()
    stop_at = started + duration

    async def sampler() -> None:
        while True:
            samples.extend(sample(roles, round(time.monotonic() - started, 1)))
            await asyncio.sleep(every)

    loads = [users(url, model, count, stop_at, USERS_KEY if keyed else None, ours)]
    if keyed:
        loads.append(limited_user(url, model, stop_at, ours))
    if beside:
        loads.append(users(beside, model, count, stop_at, None, theirs))
    watcher = asyncio.ensure_future(sampler())
    try:
        await asyncio.gather(*loads)
    finally:
        watcher.cancel()
    samples.extend(sample(roles, round(time.monotonic() - started, 1)))
    with (run_dir / "soak_samples.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(asdict(samples[0])) if samples else [])
        writer.writeheader()
        writer.writerows(asdict(s) for s in samples)
    report: dict[str, object] = {
        "scenario": "soak",
        "users": count,
        "duration_s": duration,
        "requests_ok": dict(ours.ok),
        "requests_failed": dict(ours.failed),
        "limited_key_statuses": {str(k): v for k, v in sorted(ours.limited.items())},
        "samples": len({s.at_s for s in samples}),
        "processes": {
            label: figures(samples, label)
            for label in roles
            if any(s.role == label for s in samples)
        },
    }
    if beside:
        report["vllm_serve_requests_ok"] = dict(theirs.ok)
        report["vllm_serve_requests_failed"] = dict(theirs.failed)
    return report
