"""OpenTelemetry tracing, end to end: a client's trace continues through the gateway into vLLM.

``llmgate serve --otlp-endpoint`` exports the gateway's request spans and
starts its worker with vLLM's ``--otlp-traces-endpoint``; a local collector
(tests.integration.otlp_receiver) receives both over OTLP/HTTP. Slow: it
starts its own engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    MODEL,
    Served,
    engine_on_last_core,
    launch_serve,
    module_system,
    start_gateway,
    stop_serve,
)
from tests.harness import prestart
from tests.integration.otlp_receiver import Receiver

pytestmark = pytest.mark.slow

HTTP_PROTOCOL = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}


# This module's system (tests/harness/prestart.py): under make test its module runs in the
# session of the modules with systems of their own, which starts it as the module begins.
SYSTEM_FIXTURE = "tracing_system"


def launch_system(directory: Path) -> prestart.Launched:
    """A local collector, and ``llmgate serve`` exporting to it."""
    receiver = Receiver()
    try:
        running = launch_serve(
            directory / "serve.log",
            *("--otlp-endpoint", receiver.endpoint),
            env={**HTTP_PROTOCOL, **engine_on_last_core()},
        )
    except BaseException:
        receiver.close()
        raise

    def stop() -> None:
        stop_serve(running)
        receiver.close()

    return prestart.Launched((receiver, running), stop)


@pytest.fixture(scope="module")
def tracing_system(request: pytest.FixtureRequest) -> Iterator[tuple[Receiver, Served]]:
    receiver, launched = prestart.take(request)
    try:
        with module_system(launched) as running:
            yield receiver, running
    finally:
        receiver.close()


@pytest.fixture(scope="module")
def receiver(tracing_system: tuple[Receiver, Served]) -> Receiver:
    return tracing_system[0]


@pytest.fixture(scope="module")
def traced(tracing_system: tuple[Receiver, Served]) -> Served:
    return tracing_system[1]


def spans_of(receiver: Receiver, trace_id: str, names: set[str]) -> list[dict[str, Any]]:
    """The trace's spans once all of ``names`` arrived (exports come every few seconds)."""
    deadline = time.monotonic() + 60
    while True:
        spans = receiver.of_trace(trace_id)
        if names <= {span["name"] for span in spans}:
            return spans
        assert time.monotonic() < deadline, f"{names} not received within 60 s: {spans}"
        time.sleep(0.2)


def traceparent(trace_id: str, span_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{span_id}-01"}


def test_a_request_continues_the_clients_trace_into_vllm(
    traced: Served, receiver: Receiver
) -> None:
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    response = httpx.post(
        f"{traced.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4},
        headers={**traceparent(trace_id, client_span), "X-Request-Id": "traced-1"},
        timeout=60,
    )
    assert response.status_code == 200
    spans = spans_of(receiver, trace_id, {"llmgate.request", "llm_request"})
    gateway = next(s for s in spans if s["name"] == "llmgate.request")
    engine = next(s for s in spans if s["name"] == "llm_request")
    assert gateway["service"] == "llmgate-gateway"
    assert gateway["parent_id"] == client_span
    assert gateway["attributes"]["llmgate.request_id"] == "traced-1"
    assert gateway["attributes"]["gen_ai.request.model"] == MODEL
    assert gateway["attributes"]["http.response.status_code"] == 200
    assert gateway["events"] == ["routed", "first_token"]
    # vLLM's own span, a child of the gateway's, under the same request id.
    assert engine["parent_id"] == gateway["span_id"]
    assert engine["attributes"]["gen_ai.request.id"].startswith("traced-1")
    assert engine["attributes"]["gen_ai.usage.completion_tokens"] == 4


def test_a_queued_stream_shows_its_wait(
    traced: Served, receiver: Receiver, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log_path = tmp_path_factory.mktemp("traced-gateway") / "gateway.log"
    lone = start_gateway(
        log_path,
        traced.worker_addresses(1),
        # (--queue-timeout well past any stall: the queued one waits, never a 429.)
        *("--otlp-endpoint", receiver.endpoint, "--max-inflight-per-worker", "1"),
        *("--queue-timeout", "600"),
        env=HTTP_PROTOCOL,
    )
    trace_ids = ["a" * 31 + str(i) for i in range(2)]

    async def two_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=lone.base_url, timeout=120) as client:
            # Long enough that the second arrives while the first holds the slot.
            body = {
                "model": MODEL,
                "prompt": "Hi",
                "max_tokens": 64,
                "ignore_eos": True,
                "stream": True,
            }
            return list(
                await asyncio.gather(
                    *(
                        client.post("/v1/completions", json=body, headers=traceparent(t, "b" * 16))
                        for t in trace_ids
                    )
                )
            )

    try:
        responses = asyncio.run(two_at_once())
    finally:
        stop_serve(lone)
    assert [r.status_code for r in responses] == [200, 200]
    events = [
        next(
            s for s in spans_of(receiver, t, {"llmgate.request"}) if s["name"] == "llmgate.request"
        )["events"]
        for t in trace_ids
    ]
    # One took the only slot; the other waited for it in the queue.
    assert sorted(events) == [
        ["queued", "routed", "first_token"],
        ["routed", "first_token"],
    ]
