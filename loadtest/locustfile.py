"""Locust scenarios for an OpenAI-compatible server (llmgate, or any other).

Run by ``python -m loadtest.loadtest`` (``make loadtest``), or by hand::

    .venv/bin/locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 SeedUser

Users (pick them by class name, or in the web UI with ``--class-picker``):

* ``SeedUser``: the seeds' scenario, POST ``/v1/completions`` with the prompt
  "Hello World, what is your name dog?" and ``max_tokens`` 10 (``--max-tokens``).
* ``ChatStreamUser``: POST ``/v1/chat/completions`` with ``stream: true``
  (``--chat-max-tokens``, default 64). Besides the whole request (name
  ``/v1/chat/completions (stream)``, time to the last byte) it reports two
  custom request events: ``TTFT``, the time from sending to the first chunk
  that carries content, and ``ITL``, each gap between two consecutive content
  chunks (vLLM's benchmark definition: one chunk usually is one token).

Every user is closed-loop: it sends its next request as soon as the last one
finished (``wait_time = constant(0)``). ``--warmup`` seconds after the test
starts, Locust's statistics are reset, so what the CSV and HTML report cover
is the steady state that follows. ``--summary-json`` writes the final figures
of each request name and the length of that measured window.

This module is imported by Locust only (it monkey-patches the process for
gevent); the runner starts Locust in a subprocess.
"""

from __future__ import annotations

import json
import time
from typing import Any

import gevent
import requests
from locust import FastHttpUser, User, constant, events, task
from locust.env import Environment

PROMPT = "Hello World, what is your name dog?"
CHAT_PROMPT = "Tell me a short story about a dog who asks everyone for their name."
# A server under 256 closed-loop users on two CPU cores answers in tens of
# seconds; Locust's defaults (60 s) would turn slow answers into failures.
REQUEST_TIMEOUT_S = 600.0


def _add_arguments(parser: Any, **_kwargs: Any) -> None:
    group = parser.add_argument_group("llmgate scenarios")
    group.add_argument("--model", default="", help="model name in requests ('' = server's first)")
    group.add_argument("--max-tokens", type=int, default=10, help="SeedUser's max_tokens")
    group.add_argument(
        "--chat-max-tokens", type=int, default=64, help="ChatStreamUser's max_tokens"
    )
    group.add_argument(
        "--warmup", type=float, default=0.0, help="seconds after start when stats are reset"
    )
    group.add_argument(
        "--summary-json", default="", help="write the final figures and the window here"
    )


class MeasuredWindow:
    """Resets the statistics after ``--warmup`` and writes ``--summary-json`` at the end.

    Locust's ``_stats.csv`` is a snapshot taken every second, not at the end;
    under hundreds of users completing in waves, the last second can hold a
    whole wave. This file is written once the users are stopped, with the
    exact window the figures cover.
    """

    def __init__(self) -> None:
        self.start = 0.0
        self.end = 0.0

    def on_test_start(self, environment: Environment, **_kwargs: Any) -> None:
        warmup = float(getattr(environment.parsed_options, "warmup", 0.0) or 0.0)
        self.start = time.time()
        if warmup > 0:
            # Requests that complete after the reset count, even if sent before
            # it: the closed loop is in its steady state by then.
            gevent.spawn_later(warmup, self.reset, environment)

    def reset(self, environment: Environment) -> None:
        environment.stats.reset_all()
        self.start = time.time()

    def on_test_stopping(self, environment: Environment, **_kwargs: Any) -> None:
        self.end = time.time()  # before the users are stopped

    def on_test_stop(self, environment: Environment, **_kwargs: Any) -> None:
        path = str(getattr(environment.parsed_options, "summary_json", "") or "")
        if not path:
            return
        entries = [
            {
                "type": entry.method,
                "name": entry.name,
                "requests": entry.num_requests,
                "failures": entry.num_failures,
                "mean_ms": entry.avg_response_time,
                "p50_ms": entry.get_response_time_percentile(0.5) if entry.num_requests else None,
                "p99_ms": entry.get_response_time_percentile(0.99) if entry.num_requests else None,
            }
            for entry in environment.stats.entries.values()
        ]
        document = {"window_s": max(self.end - self.start, 0.0), "entries": entries}
        with open(path, "w") as out:
            json.dump(document, out, indent=2)


_window = MeasuredWindow()
# Locust's EventHook is untyped; registering by call keeps these functions typed.
events.init_command_line_parser.add_listener(_add_arguments)  # type: ignore[no-untyped-call]
events.test_start.add_listener(_window.on_test_start)  # type: ignore[no-untyped-call]
events.test_stopping.add_listener(_window.on_test_stopping)  # type: ignore[no-untyped-call]
events.test_stop.add_listener(_window.on_test_stop)  # type: ignore[no-untyped-call]


def _model(environment: Environment, host: str) -> str:
    """``--model``, else the first model the server lists (asked once per user)."""
    configured = str(getattr(environment.parsed_options, "model", "") or "")
    if configured:
        return configured
    response = requests.get(host.rstrip("/") + "/v1/models", timeout=30)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


class SeedUser(FastHttpUser):
    wait_time = constant(0)
    network_timeout = REQUEST_TIMEOUT_S
    connection_timeout = 30.0

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.payload = {
            "model": _model(self.environment, self.host or ""),
            "prompt": PROMPT,
            "max_tokens": int(getattr(options, "max_tokens", 10)),
        }

    @task
    def completion(self) -> None:
        with self.client.post(
            "/v1/completions", json=self.payload, catch_response=True
        ) as response:
            # A 200 without choices is not a success (e.g. a proxy's error page).
            if response.status_code == 200 and not _has_choices(response.text):
                response.failure("200 without choices")


def _has_choices(body: str | None) -> bool:
    try:
        return bool(json.loads(body or "")["choices"])
    except (ValueError, KeyError, TypeError):
        return False


class ChatStreamUser(User):
    """Streams chat completions with ``requests`` and reports TTFT and ITL itself.

    Not a FastHttpUser: geventhttpclient's ``read(n)`` waits for ``n`` bytes, so
    chunks would arrive late and TTFT would be wrong. ``requests`` yields each
    HTTP chunk (one SSE event) as it arrives.
    """

    wait_time = constant(0)

    def on_start(self) -> None:
        assert self.host, "ChatStreamUser needs --host"
        options = self.environment.parsed_options
        self.url = self.host.rstrip("/") + "/v1/chat/completions"
        self.session = requests.Session()
        self.payload: dict[str, Any] = {
            "model": _model(self.environment, self.host),
            "messages": [{"role": "user", "content": CHAT_PROMPT}],
            "max_tokens": int(getattr(options, "chat_max_tokens", 64)),
            "stream": True,
        }

    def on_stop(self) -> None:
        self.session.close()

    def _fire(
        self, name: str, seconds: float, length: int = 0, error: Exception | None = None
    ) -> None:
        self.environment.events.request.fire(
            request_type="POST" if name.startswith("/") else "SSE",
            name=name,
            response_time=seconds * 1000,
            response_length=length,
            exception=error,
            context={},
        )

    @task
    def chat_stream(self) -> None:
        name = "/v1/chat/completions (stream)"
        sent = time.perf_counter()
        first: float | None = None
        last = sent
        gaps: list[float] = []
        length = 0
        done = False
        try:
            with self.session.post(
                self.url, json=self.payload, stream=True, timeout=(30, REQUEST_TIMEOUT_S)
            ) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    length += len(line)
                    if not line.startswith(b"data: "):
                        continue
                    data = line[len(b"data: ") :]
                    if data == b"[DONE]":
                        done = True
                        break
                    if not _has_content(data):
                        continue  # e.g. a role-only first chunk, or the usage chunk
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
            if not done or first is None:
                raise RuntimeError("stream ended without [DONE]" if not done else "no content")
        except (requests.RequestException, RuntimeError, ValueError) as exc:
            self._fire(name, time.perf_counter() - sent, length, exc)
            return
        self._fire(name, time.perf_counter() - sent, length)
        self._fire("TTFT", first - sent)
        for gap in gaps:
            self._fire("ITL", gap)


def _has_content(data: bytes) -> bool:
    chunk = json.loads(data)
    return any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or [])
