"""Faults with two workers, on the held double: one worker stalls briefly, or hangs.

Every request waits at its worker's gate (tests/faults/held.py) while the
test stops one worker, so the victim holds streams under way and whole
requests when the fault lands, the first time, however slow the machine.
Round-robin routing over requests sent one after another puts exactly half
of each kind on each worker. The same faults on the real engine, asserting
outcomes only: tests/integration/test_two_workers.py.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from tests.conftest import Served
from tests.faults.held import (
    BODY,
    STAYS,
    TOKENS,
    HeldWorker,
    gateway_over,
    held_worker,
    http_client,
    running_at,
)
from tests.harness.waiting import wait_until
from tests.integration.streams import Stream, read_stream
from tests.integration.test_pool import metric

# Streams and whole requests sent; half of each land on the victim.
EACH = 4


@contextmanager
def two_held(tmp_path: Path, stall_timeout: str) -> Iterator[tuple[HeldWorker, HeldWorker, Served]]:
    """Two held workers behind a round-robin gateway that marks a silent one
    down after 3 s and lets its streams wait ``stall_timeout`` seconds."""
    with ExitStack() as stack:
        # --gateway-timeout 600: a stall of the gateway itself is another test's fault.
        victim, other = (
            stack.enter_context(
                held_worker(tmp_path / f"{name}.log", "--gateway-timeout", "600", name=name)
            )
            for name in ("victim", "other")
        )
        flags = ("--policy", "round-robin", "--heartbeat-timeout", "3")
        gateway = stack.enter_context(
            gateway_over(
                tmp_path / "gateway.log",
                victim,
                other,
                flags=(*flags, "--stall-timeout", stall_timeout),
            )
        )
        yield victim, other, gateway


async def load_both(
    client: httpx.AsyncClient, gateway: Served, victim: HeldWorker, other: HeldWorker
) -> tuple[list[asyncio.Future[Stream]], list[asyncio.Future[httpx.Response]]]:
    """``EACH`` streams that cannot move, each under way before the next is
    sent, then ``EACH`` whole requests, each at a worker before the next: half
    on each worker."""
    streams: list[asyncio.Future[Stream]] = []
    for _ in range(EACH):
        first = asyncio.Event()
        streams.append(
            asyncio.ensure_future(
                read_stream(
                    client, {**BODY, **STAYS}, on_first_chunk=lambda _, first=first: first.set()
                )
            )
        )
        await asyncio.wait_for(first.wait(), 60)
    whole: list[asyncio.Future[httpx.Response]] = []
    for sent in range(1, EACH + 1):
        whole.append(asyncio.ensure_future(client.post("/v1/completions", json=BODY)))
        await asyncio.to_thread(
            wait_until,
            lambda sent=sent: (
                running_at(gateway, victim) + running_at(gateway, other) == EACH + sent
            ),
            f"{EACH + sent} requests held at the workers",
        )
    return streams, whole


def test_a_stalled_worker_keeps_its_streams_and_they_end_whole(tmp_path: Path) -> None:
    """SIGSTOP one worker briefly under load, as a starved front end would stall.

    Past --heartbeat-timeout (3 s) the gateway marks it down and moves its
    whole requests on to the other worker from the tokens they had; its
    streams under way, which cannot move (structured output), wait for
    it (--stall-timeout). Resumed, it is healthy again and those streams end
    whole, every token once, none cut.
    """
    with two_held(tmp_path, stall_timeout="300") as (victim, other, gateway):
        address = victim.address

        async def scenario() -> tuple[list[Stream], list[httpx.Response]]:
            async with http_client(gateway) as client:
                streams, whole = await load_both(client, gateway, victim, other)
                victim.process.suspend()
                try:
                    await asyncio.to_thread(
                        gateway.wait_for_log,
                        f"worker {address}: {EACH // 2} requests there wait for it",
                    )
                finally:
                    victim.process.resume()
                await asyncio.to_thread(gateway.wait_for_log, f"worker {address} speaks again")
                victim.say("release")
                other.say("release")
                return list(await asyncio.gather(*streams)), list(await asyncio.gather(*whole))

        streams, whole = asyncio.run(scenario())
        assert all(s.whole(TOKENS) for s in streams), streams
        assert sum(s.worker == address for s in streams) == EACH // 2, streams
        assert all(r.status_code == 200 for r in whole), [r.text for r in whole]
        assert all(r.json()["usage"]["completion_tokens"] == TOKENS for r in whole)
        # The victim's whole requests went on on the other worker.
        assert all(r.headers["x-llmgate-worker"] == other.address for r in whole)
        log = gateway.log_path.read_text(errors="replace")
        assert log.count(f"moving the answer on from {address} (worker_lost)") == EACH // 2, log
        assert "retrying" not in log, log
        assert "the requests that waited for it end" not in log, log
        assert "stream cut" not in log, log
        stalls = metric(
            gateway.base_url, "llmgate_worker_stalls_total", worker=address, outcome="resumed"
        )
        assert stalls == 1


def test_a_hung_worker_is_marked_down_and_rejoins(tmp_path: Path) -> None:
    """SIGSTOP one worker with streams of its under way, for longer than
    --stall-timeout (5 s here): no crash, no dropped connection, just silence.

    Within --heartbeat-timeout (3 s) the gateway marks it down: its whole
    requests go on on the other worker and it is told to abort them;
    its streams wait for it, then past --stall-timeout end with an error
    event, and it is told to abort those too. Resumed, it drops what it ran
    for us, rejoins (same incarnation) and takes traffic again.
    """
    with two_held(tmp_path, stall_timeout="5") as (victim, other, gateway):
        address = victim.address

        async def scenario() -> tuple[list[Stream], list[httpx.Response]]:
            async with http_client(gateway) as client:
                streams, whole = await load_both(client, gateway, victim, other)
                victim.process.suspend()
                try:
                    await asyncio.to_thread(
                        gateway.wait_for_log,
                        f"worker {address}: the requests that waited for it end (silent for",
                    )
                    other.say("release")
                    done = list(await asyncio.gather(*streams)), list(await asyncio.gather(*whole))
                finally:
                    victim.process.resume()
                return done

        streams, whole = asyncio.run(scenario())
        lost = re.search(
            rf"worker {re.escape(address)} lost: silent for ([\d.]+)s",
            gateway.log_path.read_text(errors="replace"),
        )
        assert lost is not None, gateway.log_tail()
        assert all(r.status_code == 200 for r in whole), [r.text for r in whole]
        assert all(r.json()["usage"]["completion_tokens"] == TOKENS for r in whole)
        # The streams under way on the victim ended with an error event; the
        # other worker's ended whole.
        cut = [s for s in streams if s.error is not None]
        assert len(cut) == EACH // 2 and all(s.worker == address for s in cut), streams
        assert all(s.tokens and s.done and "silent for" in (s.error or "") for s in cut), cut
        assert all(s.whole(TOKENS) for s in streams if s.error is None), streams
        assert (
            metric(gateway.base_url, "llmgate_worker_stalls_total", worker=address, outcome="lost")
            == 1
        )
        # Resumed, it reads the gateway's aborts and drops all it held for us...
        victim.wait_for_log("aborting the request: its gateway asked")
        wait_until(lambda: running_at(gateway, victim) == 0, "the victim idle")
        # ...and rejoins, taking traffic again.
        wait_until(
            lambda: metric(gateway.base_url, "llmgate_worker_healthy", worker=address) == 1,
            "the victim healthy",
        )
        victim.say("release")

        async def again() -> list[httpx.Response]:
            async with http_client(gateway) as client:
                return list(
                    await asyncio.gather(
                        *(client.post("/v1/completions", json=BODY) for _ in range(4))
                    )
                )

        responses = asyncio.run(again())
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        assert address in {r.headers["x-llmgate-worker"] for r in responses}
