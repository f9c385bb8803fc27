"""The pool in front of the session's real worker: cancellation, overload, deadlines, drain.

Tests that need other gateway settings start a lone ``llmgate gateway`` (it
starts in about a second) in front of the session's worker; all load is on
loopback and bounded in count and time.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL, Served, start_gateway, stop_serve

LONG = {
    "model": MODEL,
    "prompt": "Tell me a very long story.",
    "max_tokens": 2000,
    "ignore_eos": True,
}


def metric(base_url: str, name: str, **labels: str) -> float | None:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def worker_running(served: Served) -> float | None:
    """Requests the session's worker says its engine is running (from its heartbeat)."""
    return metric(
        served.base_url, "llmgate_worker_requests_running", worker=served.worker_addresses(1)
    )


def wait_for(predicate, timeout: float, interval: float = 0.1, show=None) -> float:  # type: ignore[no-untyped-def]
    """Seconds until ``predicate()`` held; fails the test after ``timeout``.

    ``show``, if given, returns what the failure message should include (a log's tail).
    """
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval)
    pytest.fail(f"condition not met within {timeout}s" + (f"\n{show()}" if show else ""))


@pytest.fixture
def gateway(served: Served, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Served]:
    """A lone gateway in front of the session's worker, with the test's extra flags."""
    marker = request.node.get_closest_marker("gateway_flags")
    flags = marker.args if marker else ()
    lone = start_gateway(tmp_path / "gateway.log", served.worker_addresses(1), *flags)
    try:
        yield lone
    finally:
        stop_serve(lone)


def test_client_disconnect_mid_stream_stops_the_engine_work(served: Served) -> None:
    with httpx.stream(
        "POST", f"{served.base_url}/v1/completions", json={**LONG, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        chunks = response.iter_lines()
        for _ in range(5):
            next(chunks)
        wait_for(lambda: (worker_running(served) or 0) >= 1, timeout=5)
    # The connection is closed: the gateway aborts, the engine drops the request.
    took = wait_for(lambda: worker_running(served) == 0, timeout=2.5)
    assert took <= 2.0


def test_client_disconnect_while_waiting_for_a_whole_response(served: Served) -> None:
    # A raw socket, so the test controls exactly when the client goes away.
    host, port = served.base_url.removeprefix("http://").split(":")
    body = httpx.Request("POST", f"{served.base_url}/v1/completions", json=LONG)
    log_start = served.log_path.stat().st_size
    with socket.create_connection((host, int(port))) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body.read())}\r\n\r\n"
        )
        sock.sendall(head.encode() + body.read())
        wait_for(lambda: (worker_running(served) or 0) >= 1, timeout=5)
    took = wait_for(lambda: worker_running(served) == 0, timeout=2.5)
    assert took <= 2.0
    # The gateway took the disconnect in its stride: no exception in its handler.
    with served.log_path.open(errors="replace") as log:
        log.seek(log_start)
        assert "Exception in ASGI application" not in log.read()


@pytest.mark.gateway_flags("--max-inflight-per-worker", "2", "--max-queue", "2")
def test_overload_gets_fast_429s_and_admitted_requests_complete(gateway: Served) -> None:
    async def burst() -> list[tuple[int, float, httpx.Headers]]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120) as client:

            async def one() -> tuple[int, float, httpx.Headers]:
                started = time.monotonic()
                response = await client.post("/v1/completions", json={**LONG, "max_tokens": 24})
                return response.status_code, time.monotonic() - started, response.headers

            return await asyncio.gather(*(one() for _ in range(12)))

    results = asyncio.run(burst())
    statuses = sorted(status for status, _, _ in results)
    # Two running, two queued; the other eight are refused at once.
    assert statuses == [200] * 4 + [429] * 8
    refused = [(took, headers) for status, took, headers in results if status == 429]
    assert all(took < 1.0 for took, _ in refused)
    assert all(headers.get("retry-after") == "1" for _, headers in refused)
    assert metric(gateway.base_url, "llmgate_rejected_total", reason="queue_full") == 8


def test_request_timeout_header_aborts_with_504(served: Served) -> None:
    started = time.monotonic()
    response = httpx.post(
        f"{served.base_url}/v1/completions",
        json=LONG,
        headers={"X-Request-Timeout": "1"},
        timeout=30,
    )
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout"
    assert time.monotonic() - started < 5
    wait_for(lambda: worker_running(served) == 0, timeout=3)


def test_bad_request_timeout_header_is_400(served: Served) -> None:
    response = httpx.post(
        f"{served.base_url}/v1/completions", json=LONG, headers={"X-Request-Timeout": "soon"}
    )
    assert response.status_code == 400


def test_sigterm_drains_in_flight_requests_then_exits_0(gateway: Served) -> None:
    async def load() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120) as client:
            requests = [
                asyncio.ensure_future(
                    client.post(
                        "/v1/completions", json={**LONG, "max_tokens": 32, "stream": i % 2 == 0}
                    )
                )
                for i in range(6)
            ]
            await asyncio.sleep(1.0)  # all six are in flight
            gateway.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*requests)

    responses = asyncio.run(load())
    assert [r.status_code for r in responses] == [200] * 6
    for response in responses:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]")
            assert '"finish_reason":"length"' in response.text
        else:
            assert response.json()["usage"]["completion_tokens"] == 32
    assert gateway.proc.wait(timeout=30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{gateway.base_url}/health")


def test_worker_aborts_the_requests_of_a_vanished_gateway(served: Served, tmp_path: Path) -> None:
    # Start from an idle worker, so the running count below is this request's.
    wait_for(lambda: worker_running(served) == 0, timeout=30, show=served.log_tail)
    lone = start_gateway(tmp_path / "gateway.log", served.worker_addresses(1))
    try:
        with httpx.stream(
            "POST", f"{lone.base_url}/v1/completions", json={**LONG, "stream": True}, timeout=60
        ) as response:
            # Keep the iterator: dropping it would close the stream (a disconnect).
            lines = response.iter_lines()
            first = next(lines)
            assert response.status_code == 200 and '"choices"' in first, first
            wait_for(lambda: (worker_running(served) or 0) >= 1, timeout=5, show=served.log_tail)
            # The gateway dies without a word: no abort reaches the worker.
            lone.proc.send_signal(signal.SIGKILL)
            lone.proc.wait()
    finally:
        stop_serve(lone)
    gateway_id = re.search(r"gateway id (gw-\w+)", lone.log_path.read_text()).group(1)  # type: ignore[union-attr]
    # The worker stops hearing its pings (10 s timeout, looked at every second)
    # and drops the request it was still running for it: not a disconnect or
    # an abort, and not the request ending on its own (2,000 tokens here take
    # minutes).
    served.wait_for_log(f"gateway b'{gateway_id}' silent for 10s: aborting 1 requests", timeout=20)
    # Its engine stops running it.
    wait_for(lambda: worker_running(served) == 0, timeout=5, show=served.log_tail)


def test_metrics_count_requests_and_tokens(served: Served) -> None:
    before = metric(served.base_url, "llmgate_generation_tokens_total", model=MODEL) or 0
    response = httpx.post(
        f"{served.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert response.status_code == 200
    after = metric(served.base_url, "llmgate_generation_tokens_total", model=MODEL)
    assert after == before + 4
    assert (
        metric(
            served.base_url,
            "llmgate_requests_total",
            model=MODEL,
            route="/v1/completions",
            status="200",
        )
        or 0
    ) >= 1
    assert metric(served.base_url, "llmgate_worker_healthy", worker=served.worker_addresses(1)) == 1
    assert metric(served.base_url, "llmgate_requests_in_flight") == 0


def test_requests_for_unserved_models_share_one_metrics_label(served: Served) -> None:
    # A client chooses the model name: each new one must not become a series.
    names = [f"no-such-model-{n}" for n in range(3)]
    for name in names:
        response = httpx.post(
            f"{served.base_url}/v1/completions", json={"model": name, "prompt": "Hi"}, timeout=10
        )
        assert response.status_code == 404
    text = httpx.get(f"{served.base_url}/metrics", timeout=5).text
    assert not any(name in text for name in names)
    unknown = metric(
        served.base_url,
        "llmgate_requests_total",
        model="unknown",
        route="/v1/completions",
        status="404",
    )
    assert unknown is not None and unknown >= 3


@pytest.mark.gateway_flags("--processes", "2")
def test_several_gateway_processes_share_the_port_and_the_metrics(gateway: Served) -> None:
    launcher = psutil.Process(gateway.proc.pid)
    servers = [p for p in launcher.children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(servers) == 2

    async def burst() -> list[int]:
        # Separate connections, so the kernel spreads them over both processes.
        async def one(i: int) -> int:
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as client:
                response = await client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": f"Hi {i}", "max_tokens": 2}
                )
                return response.status_code

        return await asyncio.gather(*(one(i) for i in range(12)))

    assert asyncio.run(burst()) == [200] * 12
    # Whichever process answers /metrics reports all processes' requests.
    for _ in range(4):
        assert (
            metric(
                gateway.base_url,
                "llmgate_requests_total",
                model=MODEL,
                route="/v1/completions",
                status="200",
            )
            == 12
        )
    gateway.proc.send_signal(signal.SIGTERM)
    assert gateway.proc.wait(timeout=30) == 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in servers)


def test_the_worker_serves_vllms_own_metrics(served: Served) -> None:
    url = f"http://127.0.0.1:{served.worker_metrics_port}/metrics"
    before = httpx.get(url, timeout=5).text
    assert "vllm:num_requests_running" in before
    response = httpx.post(
        f"{served.base_url}/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
    )
    assert response.status_code == 200

    def generated(text: str) -> float:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:generation_tokens_total":
                    return float(sample.value)
        return 0.0

    assert generated(httpx.get(url, timeout=5).text) >= generated(before) + 3
