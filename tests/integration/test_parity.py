"""Parity with ``vllm serve``: the same requests get the same answers, field by field.

vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
runs beside the session's llmgate, on the same model, dtype and engine
flags. Every request in ``parity_cases`` (completions and chat, whole and
streamed, greedy) goes to both; the JSON bodies, and for streams the whole
sequence of events, must be equal except for ids and timestamps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Served, free_port
from tests.integration.parity_cases import MODEL, cases

pytestmark = pytest.mark.slow  # starts a second engine

# Differ on every call by design.
VOLATILE = {"id", "created"}


@pytest.fixture(scope="module")
def vllm_url(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    argv = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
        *("--model", served.model_dir, "--served-model-name", MODEL),
        *("--dtype", "float32", "--enforce-eager"),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}  # as the llmgate worker has it
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("vLLM's server did not start within 300 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def normalize(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def answer(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """Status and body; for a stream, the list of its events."""
    if not body.get("stream"):
        response = httpx.post(f"{base_url}{path}", json=body, timeout=120)
        return response.status_code, normalize(response.json())
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=120) as response:
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
    return response.status_code, parsed


def _choice_index(event: Any) -> int:
    if isinstance(event, dict) and event.get("choices"):
        return int(event["choices"][0]["index"])
    return 1 << 30


CASES = cases()


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 20
    assert {path for _, path, _ in CASES} == {"/v1/completions", "/v1/chat/completions"}
    assert {body["stream"] for _, _, body in CASES} == {True, False}


@pytest.mark.parametrize(("name", "path", "body"), CASES, ids=[c[0] for c in CASES])
def test_same_answer_as_vllm_serve(
    base_url: str, vllm_url: str, name: str, path: str, body: dict[str, Any]
) -> None:
    ours = answer(base_url, path, body)
    theirs = answer(vllm_url, path, body)
    assert ours == theirs
