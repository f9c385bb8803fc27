"""Parity with ``vllm serve``: the same requests get the same answers, field by field.

vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
runs beside the session's llmgate, on the same model, dtype and flags (the
session worker's tool parser, and llmgate's worker defaults: the priority
scheduling policy, tool arguments held to their schema). Every request in
``parity_cases`` goes to both: completions and chat (whole and streamed),
one case per field of vLLM's two request types, and vLLM's other routes
(tokenize, the Responses API, ...). The status and JSON bodies, and for
streams the whole sequence of events, must be equal except for ids and
timestamps. ``-rA`` lists every case in the report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.embedded import default_model_dir
from shared.settings import EngineSettings
from tests.conftest import (
    STARTUP_TIMEOUT,
    TOOL_FLAGS,
    Served,
    engine_on_last_core,
    free_port,
    launched_ahead,
    stop_later,
)
from tests.harness import prestart
from tests.integration.parity_cases import (
    MODEL,
    ROUTE_CASES,
    cases,
    covered_fields,
    field_cases,
)
from worker import engine_plugin
from worker.main import CPU_BLOCK_SIZE

pytestmark = pytest.mark.slow  # starts a second engine

# Differ on every call by design (ids of responses, items and tool calls,
# and their timestamps).
VOLATILE = {"id", "created", "created_at", "item_id", "call_id", "response_id"}
# llmgate's worker defaults that vLLM's own are not (worker.main).
LLMGATE_DEFAULTS = ("--scheduling-policy", "priority", "--tool-strict-level", "parameter")


def cpu_defaults() -> tuple[str, ...]:
    """llmgate's worker defaults on a CPU engine (worker.main.apply_cpu_defaults)."""
    from vllm.platforms import current_platform

    return ("--block-size", str(CPU_BLOCK_SIZE)) if current_platform.is_cpu() else ()


# vLLM's server starts while the module before this one runs (tests/harness/prestart.py).
SYSTEM_FIXTURE = "vllm_url"


def launch_system(directory: Path) -> prestart.Launched:
    """vLLM's own server on the embedded model (the session's converted copy)."""
    port = free_port()
    log_path = directory / "vllm.log"
    argv = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(default_model_dir()), "--served-model-name", MODEL),
        *("--dtype", "float32", "--enforce-eager"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *TOOL_FLAGS,
        *LLMGATE_DEFAULTS,
        *cpu_defaults(),
    ]
    # As the llmgate worker has them: a 1 GiB KV cache, and vLLM's processes
    # sleeping rather than spinning between steps (worker.engine_plugin, in
    # this environment's vLLM too; it changes when a process waits, not what
    # the engine computes), so the two engines do not spin on each other's core.
    busy_wait = str(EngineSettings().engine_busy_wait)
    # On the last core, so the two engines answer side by side.
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        engine_plugin.ENV: busy_wait,
        **engine_on_last_core(),
    }
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Served(proc, f"http://127.0.0.1:{port}", log_path)
    return launched_ahead(server)


@pytest.fixture(scope="module")
def vllm_url(request: pytest.FixtureRequest) -> Iterator[str]:
    server: Served = prestart.take(request)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            assert server.proc.poll() is None, server.log_tail()
            try:
                if httpx.get(f"{server.base_url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail(f"vLLM's server did not start within {STARTUP_TIMEOUT} s")
        yield server.base_url
    finally:
        stop_later(server)


def normalize(value: Any) -> Any:
    if isinstance(value, dict) and isinstance(value.get("error"), dict):
        # A deliberate difference: llmgate's errors carry OpenAI's types
        # ("invalid_request_error", code null), vLLM's its exception class
        # names and the status. Status, message and param must be equal.
        error = value["error"]
        return {"error": {k: error.get(k) for k in ("message", "param")}}
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def answer(
    base_url: str, path: str, body: dict[str, Any] | None, method: str = "POST"
) -> tuple[int, Any]:
    """Status and body; for a stream, the list of its events."""
    if not (body or {}).get("stream"):
        response = httpx.request(method, f"{base_url}{path}", json=body, timeout=120)
        content = response.json() if response.content else None
        return response.status_code, normalize(content)
    with httpx.stream(method, f"{base_url}{path}", json=body, timeout=120) as response:
        events = [
            line.removeprefix("data: ")
            for line in response.iter_lines()
            if line.startswith("data: ")
        ]
    parsed = [e if e == "[DONE]" else normalize(json.loads(e)) for e in events]
    # Choices of different prompts interleave in whatever order the engine's
    # outputs arrive, in vLLM's server as in ours: compare each choice's own
    # sequence (a stable sort keeps it), with usage and [DONE] last.
    parsed.sort(key=_choice_index)
    return response.status_code, coalesce(parsed)


# Text that a later chunk continues: concatenated when chunks are joined.
_JOINED_TEXT = {"content", "text", "reasoning", "arguments"}


def coalesce(events: list[Any]) -> list[Any]:
    """A stream with each choice's run of output chunks joined into one.

    Where one token's chunk ends and the next begins is timing, in vLLM's
    server as in ours: when its front end falls behind the engine, vLLM
    merges the outputs it has not handed over yet (a paused or starved
    process, as on this 2-core machine with two engines). What is compared is
    what the chunks carry: the text, logprobs and token ids in order, and the
    chunks around them (role, finish, usage). The Responses API's text
    deltas are joined the same way, and its events numbered anew (a CI run
    failed on ``"The capital"`` coming as one delta from one server, two from
    the other).
    """
    out: list[Any] = []
    for event in events:
        previous = out[-1] if out else None
        if _output_chunk(event) and _output_chunk(previous) and _same_choice(previous, event):
            if previous["choices"][0].get("finish_reason") is None:
                out[-1] = _join(previous, event)
                continue
        if _same_responses_delta(previous, event):
            out[-1] = {**previous, "delta": previous["delta"] + event["delta"]}
            if isinstance(previous.get("logprobs"), list):
                out[-1]["logprobs"] = previous["logprobs"] + event["logprobs"]
            continue
        out.append(event)
    if any(isinstance(e, dict) and "sequence_number" in e for e in out):
        # The Responses API numbers its events: joined, they number anew.
        numbered = (e for e in out if isinstance(e, dict) and "sequence_number" in e)
        for number, event in enumerate(numbered):
            event["sequence_number"] = number
    return out


def _same_responses_delta(a: Any, b: Any) -> bool:
    """Two Responses API text deltas in a row of one output and content part
    (``response.output_text.delta`` and the like): parts of one run of text."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    kind = b.get("type")
    return (
        isinstance(kind, str)
        and kind.startswith("response.")
        and kind.endswith(".delta")
        and a.get("type") == kind
        and isinstance(a.get("delta"), str)
        and isinstance(b.get("delta"), str)
        and all(a.get(k) == b.get(k) for k in ("output_index", "content_index"))
    )


def _output_chunk(event: Any) -> bool:
    # With continuous_usage_stats every output chunk carries the usage so far:
    # joined, the later (cumulative) one stands, as if the chunks had come as one.
    if not isinstance(event, dict) or len(event.get("choices") or []) != 1:
        return False
    delta = event["choices"][0].get("delta")
    return not (isinstance(delta, dict) and "role" in delta)


def _same_choice(a: Any, b: Any) -> bool:
    return bool(a["choices"][0].get("index") == b["choices"][0].get("index"))


def _join(a: Any, b: Any, key: str = "") -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _join(a.get(k), b.get(k), k) for k in {**a, **b}}
    if isinstance(a, list) and isinstance(b, list) and key == "tool_calls":
        # Fragments of one call (same index) in a row are one fragment, merged.
        calls: list[Any] = []
        for fragment in a + b:
            if calls and calls[-1].get("index") == fragment.get("index"):
                calls[-1] = _join(calls[-1], fragment)
            else:
                calls.append(fragment)
        return calls
    if isinstance(a, list) and isinstance(b, list) and key != "choices":
        return a + b
    if isinstance(a, list) and isinstance(b, list):
        return [_join(x, y) for x, y in zip(a, b, strict=True)]
    if isinstance(a, str) and isinstance(b, str) and key in _JOINED_TEXT:
        return a + b
    return b if b is not None else a


def _choice_index(event: Any) -> int:
    if isinstance(event, dict) and event.get("choices"):
        return int(event["choices"][0]["index"])
    return 1 << 30


def both(call: Any, ours: tuple[Any, ...], theirs: tuple[Any, ...]) -> tuple[Any, Any]:
    """``call`` on both servers at once: each has its own engine (and this
    machine two cores), so the suite waits for one request, not two."""
    with ThreadPoolExecutor(2) as pool:
        mine = pool.submit(call, *ours)
        other = pool.submit(call, *theirs)
        return mine.result(), other.result()


CASES = cases() + field_cases()


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 20
    assert {path for _, path, _ in CASES} == {"/v1/completions", "/v1/chat/completions"}
    assert {body["stream"] for _, _, body in CASES} == {True, False}


def test_every_field_of_vllms_request_types_has_a_case() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    assert set(CompletionRequest.model_fields) - covered_fields("completion") == set()
    assert set(ChatCompletionRequest.model_fields) - covered_fields("chat") == set()


@pytest.mark.parametrize(("name", "path", "body"), CASES, ids=[c[0] for c in CASES])
def test_same_answer_as_vllm_serve(
    base_url: str, vllm_url: str, name: str, path: str, body: dict[str, Any]
) -> None:
    ours, theirs = both(answer, (base_url, path, body), (vllm_url, path, body))
    assert ours == theirs


@pytest.mark.parametrize(
    ("name", "method", "path", "body"), ROUTE_CASES, ids=[c[0] for c in ROUTE_CASES]
)
def test_same_route_answer_as_vllm_serve(
    base_url: str, vllm_url: str, name: str, method: str, path: str, body: dict[str, Any] | None
) -> None:
    ours, theirs = both(answer, (base_url, path, body, method), (vllm_url, path, body, method))
    assert ours == theirs
