"""The pool in front of the session's real worker: cancellation, overload, deadlines, drain.

Tests that need other gateway settings start a lone ``llmgate gateway`` (it
starts in about a second) in front of the session's worker; all load is on
loopback and bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from tests.integration.streams import TOKENS_SHOWN, Stream, read_stream

# A request that runs for minutes on this CPU (4,000 tokens: over 5), so
# that a test's action (a disconnect, an abort, a deadline) lands while it
# runs even when the machine stalls the test for a while.
LONG = {
    "model": MODEL,
    "prompt": "Tell me a very long story.",
    "max_tokens": 4000,
    "ignore_eos": True,
}


def metric(base_url: str, name: str, **labels: str) -> float | None:
    return value_in(httpx.get(f"{base_url}/metrics", timeout=30).text, name, **labels)


def value_in(text: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` with ``labels`` in a Prometheus page; None if absent."""
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
    took = seconds_until(predicate, timeout, interval)
    if took is None:
        pytest.fail(f"condition not met within {timeout}s" + (f"\n{show()}" if show else ""))
    return took


def seconds_until(predicate, timeout: float, interval: float = 0.1) -> float | None:  # type: ignore[no-untyped-def]
    """Seconds until ``predicate()`` held; None if it did not within ``timeout``."""
    started = time.monotonic()
    while True:
        # Checked once more past the deadline: a test stalled for the whole
        # wait has not looked yet.
        late = time.monotonic() - started >= timeout
        if predicate():
            return time.monotonic() - started
        if late:
            return None
        time.sleep(interval)


@pytest.fixture
def gateway(served: Served, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Served]:
    """A lone gateway in front of the session's worker, with the test's extra flags.

    It keeps a worker silent for under a minute (--heartbeat-timeout 60, not
    3) unless the test sets its own: on this shared machine the worker's
    front end is sometimes starved for seconds, and a test about the queue, a
    drain or an overload must not turn into one about failover."""
    marker = request.node.get_closest_marker("gateway_flags")
    flags = marker.args if marker else ()
    if "--heartbeat-timeout" not in flags:
        flags = ("--heartbeat-timeout", "60", *flags)
    lone = start_gateway(tmp_path / "gateway.log", served.worker_addresses(1), *flags)
    try:
        yield lone
    finally:
        stop_serve(lone)


def aborted(rid: str) -> str:
    """The worker's log line for a request its gateway told it to abort."""
    return f"aborting the request: its gateway asked [request_id={rid}]"


def raw_post(base_url: str, body: dict, request_id: str) -> socket.socket:
    """Send a completions request on a raw socket, so the test decides when the client leaves."""
    host, port = base_url.removeprefix("http://").split(":")
    content = httpx.Request("POST", base_url, json=body).read()
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nX-Request-Id: {request_id}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(content)}\r\n\r\n"
    )
    sock.sendall(head.encode() + content)
    return sock


def in_flight(served: Served) -> float:
    return metric(served.base_url, "llmgate_requests_in_flight") or 0


async def metric_reaches(
    client: httpx.AsyncClient, name: str, count: float, within: float = 120, **labels: str
) -> None:
    """Until the gateway of ``client`` reports ``name`` (with ``labels``) at
    ``count`` or more; fails, saying what it waited for, after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        page = await client.get("/metrics")
        assert page.status_code == 200, page.text  # with keys: an admin key's
        value = value_in(page.text, name, **labels)
        if (value or 0) >= count:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} {labels} still {value} after {within}s, not {count}")
        await asyncio.sleep(0.1)


async def in_flight_reaches(client: httpx.AsyncClient, count: int) -> None:
    """Until the gateway of ``client`` counts ``count`` requests in flight."""
    await metric_reaches(client, "llmgate_requests_in_flight", count)


def describe(request: asyncio.Future[httpx.Response]) -> str:
    """How a request that ended went: its status and body, or its exception."""
    if request.exception() is not None:
        return repr(request.exception())
    response = request.result()
    return f"{response.status_code} {response.text[:300]}"


def test_client_disconnect_mid_stream_stops_the_engine_work(served: Served) -> None:
    rid = f"mid-stream-{time.time_ns()}"
    with httpx.stream(
        "POST",
        f"{served.base_url}/v1/completions",
        json={**LONG, "stream": True},
        headers={"X-Request-Id": rid},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-request-id"] == rid
        chunks = response.iter_lines()
        for _ in range(5):
            next(chunks)  # tokens: the worker is running it
    # The connection is closed: the gateway aborts, the engine drops the request
    # (LONG would take minutes to finish on its own).
    served.wait_for_log(aborted(rid), timeout=60)
    wait_for(lambda: worker_running(served) == 0, timeout=60, show=served.log_tail)


def test_client_disconnect_while_waiting_for_a_whole_response(served: Served) -> None:
    rid = f"whole-{time.time_ns()}"
    log_start = served.log_path.stat().st_size
    with raw_post(served.base_url, LONG, rid):
        # Sent to the worker (the gateway counts it in flight), then the client leaves.
        wait_for(lambda: in_flight(served) >= 1, timeout=60, show=served.log_tail)
    served.wait_for_log(aborted(rid), timeout=60)
    wait_for(lambda: in_flight(served) == 0, timeout=60, show=served.log_tail)
    wait_for(lambda: worker_running(served) == 0, timeout=60, show=served.log_tail)
    # The gateway took the disconnect in its stride: no exception in its handler.
    with served.log_path.open(errors="replace") as log:
        log.seek(log_start)
        assert "Exception in ASGI application" not in log.read()


# --queue-timeout well past any stall: the queued stream ends by its client
# leaving (a 499), never by its wait timing out (a 429).
@pytest.mark.gateway_flags("--max-inflight-per-worker", "1", "--queue-timeout", "600")
def test_streaming_client_leaving_the_queue_is_removed_from_it(
    served: Served, gateway: Served
) -> None:
    before = metric(
        gateway.base_url, "llmgate_requests_total", status="499", route="/v1/completions"
    )
    # One request takes the worker's only slot here; a streaming one queues
    # behind it. The engine is stopped meanwhile, so the holder cannot end on
    # its own however late the test looks (a CI run once found it gone).
    with engine_stopped(served), raw_post(gateway.base_url, LONG, f"holder-{time.time_ns()}"):
        wait_for(lambda: in_flight(gateway) == 1, timeout=60, show=gateway.log_tail)
        with raw_post(gateway.base_url, {**LONG, "stream": True}, f"queued-{time.time_ns()}"):
            wait_for(
                lambda: metric(gateway.base_url, "llmgate_queue_depth") == 1,
                timeout=60,
                show=gateway.log_tail,
            )
        # The streaming client left while queued: out of the queue, counted as 499.
        wait_for(
            lambda: metric(gateway.base_url, "llmgate_queue_depth") == 0,
            timeout=60,
            show=gateway.log_tail,
        )
        # It never reached the worker, and the holder still runs.
        assert in_flight(gateway) == 1, gateway.log_tail()
    wait_for(lambda: in_flight(gateway) == 0, timeout=60, show=gateway.log_tail)
    after = metric(
        gateway.base_url, "llmgate_requests_total", status="499", route="/v1/completions"
    )
    assert (after or 0) - (before or 0) == 2  # the queued stream, then the holder


def worker_of(served: Served) -> psutil.Process:
    launcher = psutil.Process(served.proc.pid)
    return next(p for p in launcher.children() if "worker.main" in p.cmdline())


@contextlib.contextmanager
def engine_stopped(served: Served) -> Iterator[None]:
    """Stop the session worker's engine processes (vLLM's EngineCore and its
    compute process) while the worker's own loop runs on: the requests it
    holds then cannot end on their own, however long the test takes on a
    busy machine. Resumed on the way out."""
    engine = worker_of(served).children(recursive=True)
    for proc in engine:
        proc.suspend()
    try:
        yield
    finally:
        for proc in engine:
            proc.resume()


def resume_and_wait_healthy(served: Served, worker: psutil.Process) -> None:
    """Resume a suspended session worker; wait until the session's gateway uses it again."""
    worker.resume()
    wait_healthy(served)


def wait_healthy(served: Served) -> None:
    """Until the session's gateway counts its worker healthy (60 s at most)."""
    wait_for(
        lambda: (
            metric(served.base_url, "llmgate_worker_healthy", worker=served.worker_addresses(1))
            == 1
        ),
        timeout=60,
        show=served.log_tail,
    )


def test_streaming_client_leaving_before_its_first_token_aborts_it(
    served: Served, gateway: Served
) -> None:
    rid = f"before-first-token-{time.time_ns()}"
    worker = worker_of(served)
    # A paused worker: the request reaches it, and no token can come back.
    worker.suspend()
    try:
        with raw_post(gateway.base_url, {**LONG, "stream": True}, rid):
            wait_for(lambda: in_flight(gateway) == 1, timeout=60, show=gateway.log_tail)
        # The client left before its first token: the gateway lets go and counts a 499...
        wait_for(lambda: in_flight(gateway) == 0, timeout=60, show=gateway.log_tail)
        assert (
            metric(
                gateway.base_url, "llmgate_requests_total", status="499", route="/v1/completions"
            )
            == 1
        )
        assert "client disconnected before the response started" in gateway.log_path.read_text()
    finally:
        resume_and_wait_healthy(served, worker)
    # ...and the worker, once it runs again, is told to abort it.
    served.wait_for_log(aborted(rid), timeout=60)
    wait_for(lambda: worker_running(served) == 0, timeout=60, show=served.log_tail)


# Pauses of the front end in one stream, at most. How the resumed front end
# takes in its backlog is up to the timing of vLLM's own event loop and
# ZeroMQ thread, so a pause may end with no two outputs merged (a CI run
# once saw none); the stream is then paused again.
PAUSES = 4


@pytest.mark.gateway_flags("--heartbeat-timeout", "60")
def test_a_paused_worker_front_end_loses_no_token(served: Served, gateway: Served) -> None:
    """The cause of the killing test's rare "wrong number of chunks", pinned.

    While a worker's front end is paused (here SIGSTOP; in that test, a core
    taken by a restarting worker) its engine runs on, and vLLM merges the
    outputs it could not hand over into one: one chunk then carries several
    tokens. Every token still arrives, in order, once: the stream's text is
    the same as the whole response's.
    """
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        # Room for every pause: the engine runs on through each (about 40
        # tokens a second here on one core).
        "max_tokens": 240,
        "ignore_eos": True,
        "temperature": 0,
    }
    whole = httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=300).json()
    worker = worker_of(served)

    async def paused_mid_stream() -> tuple[Stream, int, bool]:
        """The stream, its pauses, and whether a chunk after a pause merged tokens."""
        stream = Stream()
        pauses, pause_at, merged = 0, 5, False
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120) as client:
            async with client.stream(
                "POST", "/v1/completions", json={**body, **TOKENS_SHOWN, "stream": True}
            ) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    before = len(stream.tokens)
                    stream.read_line(line)
                    # A busy machine merges outputs now and then unpaused too:
                    # only a merge after a pause shows the pause's.
                    merged = merged or (pauses > 0 and len(stream.tokens) - before > 1)
                    if merged or pauses == PAUSES or len(stream.tokens) < pause_at:
                        continue
                    worker.suspend()
                    try:
                        await asyncio.sleep(1)  # the pause itself, not a wait for an event
                    finally:
                        worker.resume()
                    pauses += 1
                    pause_at = len(stream.tokens) + 10
        return stream, pauses, merged

    try:
        stream, pauses, merged = asyncio.run(paused_mid_stream())
    finally:
        resume_and_wait_healthy(served, worker)
    assert merged, f"no merged chunk after {pauses} pauses: {stream}"
    assert stream.whole(whole["usage"]["completion_tokens"]), stream
    assert stream.text == whole["choices"][0]["text"]


# The gateway's log line when the machine, not its own work, held its event
# loop (shared.ticks).
STARVED = re.compile(r"this gateway's event loop woke [\d.]+s late \(the process was paused")


# --stall-timeout well past any stall of the test: the requests wait for the
# worker until the test resumes it, not for the default 30 s.
@pytest.mark.gateway_flags("--heartbeat-timeout", "3", "--stall-timeout", "300")
def test_a_lone_real_worker_that_stalls_ends_every_request(served: Served, gateway: Served) -> None:
    """Outcomes only, on the real engine: a lone worker stopped (front end and
    engine) past --heartbeat-timeout, then resumed: both its requests end, a
    stream and a plain request, whole or with the error the design names;
    none hangs, no token is lost. The exact scenario, on the held double:
    tests/faults/test_one_worker.py."""
    TOKENS = 200  # an outcome test: the requests may end before the stop, or after it
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }
    address = served.worker_addresses(1)
    worker = worker_of(served)
    stopped = [worker, *worker.children(recursive=True)]  # front end and engine: a hang
    since = len(gateway.log_path.read_text(errors="replace"))

    async def stalled_mid_request() -> tuple[httpx.Response, Stream]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=300) as client:
            plain = asyncio.ensure_future(client.post("/v1/completions", json=body))
            stream = asyncio.ensure_future(read_stream(client, body))
            await in_flight_reaches(client, 2)
            for proc in stopped:
                proc.suspend()
            try:
                await asyncio.to_thread(
                    gateway.wait_for_log, f"worker {address} lost: silent for", 60, since
                )
            finally:
                for proc in stopped:
                    proc.resume()
            return await plain, await stream

    plain, stream = asyncio.run(stalled_mid_request())
    # Whole, or (had the machine stalled the gateway past the worker's
    # --gateway-timeout meanwhile) a 503 naming that cause: never a cut.
    assert plain.status_code in (200, 503), plain.text
    if plain.status_code == 200:
        assert plain.json()["usage"]["completion_tokens"] == TOKENS
    assert stream.done, stream
    assert stream.whole(TOKENS) or "--gateway-timeout" in (stream.error or ""), stream
    wait_healthy(served)
    wait_for(lambda: worker_running(served) == 0, timeout=60, show=served.log_tail)


def test_a_gateway_paused_on_the_real_engine_gets_its_requests_ended_not_hung(
    served: Served, gateway: Served
) -> None:
    """Outcomes only, on the real engine: a gateway paused past the worker's
    --gateway-timeout (30 s), then resumed: its stream ends (with the error
    naming --gateway-timeout, or whole had it finished first), its plain
    request is not lost (it runs again, or ended whole); nothing hangs. The
    exact scenario, on the held double: tests/faults/test_one_worker.py."""
    gateway_id = re.search(r"gateway id (gw-\w+)", gateway.log_path.read_text()).group(1)  # type: ignore[union-attr]
    paused = psutil.Process(gateway.proc.pid)
    body = {**LONG, "max_tokens": 400}
    worker_since = len(served.log_path.read_text(errors="replace"))

    async def paused_mid_request() -> tuple[Stream, asyncio.Future[httpx.Response]]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=300) as client:
            streaming = asyncio.Event()
            plain = asyncio.ensure_future(client.post("/v1/completions", json=body))
            stream = asyncio.ensure_future(
                read_stream(client, body, on_first_chunk=lambda _: streaming.set())
            )
            await asyncio.wait_for(streaming.wait(), 120)
            paused.suspend()
            try:
                await asyncio.to_thread(
                    served.wait_for_log,
                    f"gateway b'{gateway_id}' silent for 30s: aborting",
                    120,
                    worker_since,
                )
            finally:
                paused.resume()
            ended = await asyncio.wait_for(stream, 120)
            # The plain request: ended whole, or running again at the worker.
            await asyncio.to_thread(
                wait_for,
                lambda: plain.done() or (worker_running(served) or 0) >= 1,
                60,
                0.1,
                served.log_tail,
            )
            if not plain.done():
                plain.cancel()  # the client leaves: it is not lost, it runs
            return ended, plain

    stream, plain = asyncio.run(paused_mid_request())
    assert stream.done and stream.tokens, stream
    assert stream.whole(400) or "--gateway-timeout" in (stream.error or ""), stream
    if not plain.cancelled():
        assert plain.result().status_code == 200, plain.result().text
    wait_for(lambda: worker_running(served) == 0, timeout=60, show=served.log_tail)


# --queue-timeout well past any stall: the two queued requests wait for the
# stopped engine, not for the default 30 s, then a 429.
@pytest.mark.gateway_flags(
    "--max-inflight-per-worker", "2", "--max-queue", "2", "--queue-timeout", "600"
)
def test_overload_gets_fast_429s_and_admitted_requests_complete(
    served: Served, gateway: Served
) -> None:
    async def burst(client: httpx.AsyncClient) -> tuple[list[asyncio.Future], list[httpx.Response]]:
        def post() -> asyncio.Future[httpx.Response]:
            return asyncio.ensure_future(
                client.post("/v1/completions", json={**LONG, "max_tokens": 64})
            )

        # Two running and two queued, as the gateway counts them...
        admitted = [post() for _ in range(4)]
        await metric_reaches(client, "llmgate_queue_depth", 2)
        # ...then eight more, refused at once.
        refused = await asyncio.gather(*(post() for _ in range(8)))
        assert not any(request.done() for request in admitted)
        return admitted, refused

    async def overload() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=300) as client:
            # The engine is stopped while the burst arrives, so no admitted
            # request can end and free a place first. (With it running, CI's
            # test process once stalled 29 s after the queue filled; the
            # admitted requests ended meanwhile and four of the eight were
            # admitted in their turn.)
            with engine_stopped(served):
                admitted, refused = await burst(client)
            return await asyncio.gather(*admitted), refused

    # Start from an idle worker: the stopped engine holds only this test's requests.
    wait_for(lambda: worker_running(served) == 0, timeout=60, show=served.log_tail)
    admitted, refused = asyncio.run(overload())
    assert [r.status_code for r in refused] == [429] * 8, [r.text for r in refused]
    assert all(r.headers.get("retry-after") == "1" for r in refused)
    assert metric(gateway.base_url, "llmgate_rejected_total", reason="queue_full") == 8
    # The admitted ones, once the engine runs again, complete in full.
    assert [r.status_code for r in admitted] == [200] * 4, [r.text for r in admitted]
    assert all(r.json()["usage"]["completion_tokens"] == 64 for r in admitted)


def test_request_timeout_header_aborts_with_504(served: Served) -> None:
    started = time.monotonic()
    response = httpx.post(
        f"{served.base_url}/v1/completions",
        json=LONG,
        headers={"X-Request-Timeout": "1"},
        timeout=180,
    )
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout"
    # Ended at its deadline, not at its end (over five minutes away).
    assert time.monotonic() - started < 180
    wait_for(lambda: worker_running(served) == 0, timeout=60, show=served.log_tail)


def test_bad_request_timeout_header_is_400(served: Served) -> None:
    response = httpx.post(
        f"{served.base_url}/v1/completions",
        json=LONG,
        headers={"X-Request-Timeout": "soon"},
        timeout=60,
    )
    assert response.status_code == 400


# Drained however slow the machine: six answers can take longer than the
# default 30 s on a busy CPU; this test is about draining.
@pytest.mark.gateway_flags("--drain-timeout", "300")
def test_sigterm_drains_in_flight_requests_then_exits_0(served: Served, gateway: Served) -> None:
    TOKENS = 64

    async def load() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=300) as client:
            # The engine is stopped until the drain has begun, so all six are
            # still in flight when the SIGTERM lands, however slow the machine.
            with engine_stopped(served):
                requests = [
                    asyncio.ensure_future(
                        client.post(
                            "/v1/completions",
                            json={**LONG, "max_tokens": TOKENS, "stream": i % 2 == 0},
                        )
                    )
                    for i in range(6)
                ]
                # All six in flight; one that ends first says why in its answer.
                all_in = asyncio.ensure_future(in_flight_reaches(client, 6))
                await asyncio.wait(
                    [all_in, *requests], timeout=120, return_when=asyncio.FIRST_COMPLETED
                )
                if not all_in.done():
                    all_in.cancel()
                    ended = [describe(r) for r in requests if r.done()]
                    pytest.fail(f"not 6 in flight; ended first: {ended}\n{gateway.log_tail()}")
                gateway.proc.send_signal(signal.SIGTERM)
                # uvicorn's word that it stops taking connections and waits
                # for the open ones.
                await asyncio.to_thread(gateway.wait_for_log, "Shutting down", 60)
                assert not any(r.done() for r in requests)
            return await asyncio.gather(*requests)

    # Start from an idle worker: the stopped engine holds only this test's requests.
    wait_for(lambda: worker_running(served) == 0, timeout=60, show=served.log_tail)
    responses = asyncio.run(load())
    assert [r.status_code for r in responses] == [200] * 6
    for response in responses:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]")
            assert '"finish_reason":"length"' in response.text
        else:
            assert response.json()["usage"]["completion_tokens"] == TOKENS
    assert gateway.proc.wait(timeout=30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{gateway.base_url}/health", timeout=60)


def test_worker_aborts_the_requests_of_a_vanished_gateway(served: Served, tmp_path: Path) -> None:
    # Start from an idle worker, so the running count below is this request's.
    wait_for(lambda: worker_running(served) == 0, timeout=30, show=served.log_tail)
    # The worker's engine is stopped throughout, its own loop runs on: the
    # request cannot end on its own, however long this takes on a busy
    # machine. (With the engine running, a request long enough to fill the
    # context once ended before the worker noticed the silence: in CI, six
    # minutes passed between its first token and the gateway's kill.)
    lone = start_gateway(tmp_path / "gateway.log", served.worker_addresses(1))
    rid = f"orphan-{time.time_ns()}"
    try:
        with engine_stopped(served):
            with raw_post(lone.base_url, {**LONG, "stream": True}, rid):
                # The worker holds it: its count of unfinished requests is its
                # own (vLLM's front end), sent in its heartbeats, not the engine's.
                wait_for(
                    lambda: (worker_running(served) or 0) >= 1, timeout=60, show=served.log_tail
                )
                # The gateway dies without a word: no abort reaches the worker.
                lone.proc.send_signal(signal.SIGKILL)
                lone.proc.wait()
            gateway_id = re.search(r"gateway id (gw-\w+)", lone.log_path.read_text()).group(1)  # type: ignore[union-attr]
            # Its connection drops with it: the worker drops the request it held
            # for it then, not after --gateway-timeout (30 s) of silence, and not
            # for an abort (none was sent) or the request ending on its own.
            # (A 90 s bound: the worker itself may be starved a while; past
            # 30 s its log would say "silent" instead, and this fails.)
            served.wait_for_log(
                f"gateway b'{gateway_id}' disconnected: aborting 1 requests", timeout=90
            )
            served.wait_for_log(f"its gateway disconnected [request_id={rid}]", timeout=60)
            # vLLM forgets it at once; the engine, once resumed, never runs it.
            wait_for(lambda: worker_running(served) == 0, timeout=30, show=served.log_tail)
    finally:
        stop_serve(lone)
    # The resumed engine serves the next request.
    response = httpx.post(
        f"{served.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        timeout=120,
    )
    assert response.status_code == 200, response.text


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
    assert metric(served.base_url, "llmgate_requests_in_flight") == 0
    # Healthy: at once unless a starved front end missed a heartbeat just now.
    wait_healthy(served)


def test_requests_for_unserved_models_share_one_metrics_label(served: Served) -> None:
    # A client chooses the model name: each new one must not become a series.
    names = [f"no-such-model-{n}" for n in range(3)]
    for name in names:
        response = httpx.post(
            f"{served.base_url}/v1/completions", json={"model": name, "prompt": "Hi"}, timeout=60
        )
        assert response.status_code == 404
    text = httpx.get(f"{served.base_url}/metrics", timeout=30).text
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

    async def all_counted() -> None:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as client:
            await metric_reaches(
                client,
                "llmgate_requests_total",
                12,
                model=MODEL,
                route="/v1/completions",
                status="200",
            )

    # Each process writes its counts out within a second (gateway.metrics.flush).
    asyncio.run(all_counted())
    # Whichever process answers /metrics reports all processes' requests, no more.
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
    before = httpx.get(url, timeout=30).text
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

    assert generated(httpx.get(url, timeout=30).text) >= generated(before) + 3
