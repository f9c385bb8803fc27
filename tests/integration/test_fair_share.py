"""Fair sharing between API keys end to end: a lone gateway with one slot in front of the
session's worker (the real engine), two keys, one flooding it.

The outcome is an order, never a time: with one slot the requests run one
after the other, so the order in which their responses arrive is the order
in which they got the slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL, Served, start_gateway, stop_serve
from tests.integration.test_pool import metric_reaches

FLOODER = "sk-llmgate-test-flooder"
QUIET = "sk-llmgate-test-quiet"
# An operator's key: /metrics is theirs alone.
OPS = "sk-llmgate-test-ops"
# Six long requests (160 tokens: seconds each on this CPU, more on a busy
# machine): one runs and five wait when the quiet request comes. Even if the
# test process stalls for as long as three of them take, some of the flood
# queued ahead of it is still waiting when it is queued.
FLOOD = 6
FLOOD_TOKENS = 160


def keys_file(directory: Path) -> Path:
    path = directory / "keys.yaml"
    path.write_text(
        f"keys:\n  - name: flooder\n    key: {FLOODER}\n  - name: quiet\n    key: {QUIET}\n"
        f"  - name: ops\n    key: {OPS}\n    admin: true\n"
    )
    return path


def start(served: Served, directory: Path, *flags: str) -> Served:
    return start_gateway(
        directory / "gateway.log",
        served.worker_addresses(1),
        *("--api-keys-file", str(keys_file(directory))),
        *("--max-inflight-per-worker", "1", "--queue-timeout", "600"),
        *flags,
    )


@pytest.fixture(scope="module")
def fair(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = start(served, tmp_path_factory.mktemp("fair-share"))
    try:
        yield gateway
    finally:
        stop_serve(gateway)


@pytest.fixture(scope="module")
def unfair(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = start(served, tmp_path_factory.mktemp("no-fair-share"), "--fair-share", "false")
    try:
        yield gateway
    finally:
        stop_serve(gateway)


async def completion_order(gateway: Served, tokens: int = FLOOD_TOKENS) -> tuple[list[str], int]:
    """The flooder queues ``FLOOD`` long requests, then the quiet key one short one:
    who finished in which order up to the quiet one (the flood still running
    then is not waited for: its client leaves), and how many had finished when
    the quiet one was sent."""
    finished: list[str] = []

    async def post(client: httpx.AsyncClient, key: str, label: str, tokens: int) -> None:
        body = {"model": MODEL, "prompt": f"{label}: count to fifty.", "max_tokens": tokens}
        body["ignore_eos"] = True
        response = await client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 200, response.text
        finished.append(label)

    operator = {"Authorization": f"Bearer {OPS}"}  # reads /metrics; each post has its own
    async with httpx.AsyncClient(
        base_url=gateway.base_url, timeout=600, headers=operator
    ) as client:
        flood = [
            asyncio.create_task(post(client, FLOODER, f"flood-{i}", tokens)) for i in range(FLOOD)
        ]
        # One runs, the rest wait: then the quiet key's request arrives behind them.
        await metric_reaches(client, "llmgate_queue_depth", FLOOD - 1, within=300)
        before = len(finished)
        await post(client, QUIET, "quiet", 2)
        for request in flood:
            request.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    return finished, before


async def test_a_quiet_key_is_served_before_a_flood_queued_ahead_of_it(fair: Served) -> None:
    finished, before = await completion_order(fair)
    # It overtook flood requests queued ahead of it: right after the one
    # running when it came, unless the test was late to send it (``before``
    # counts what the test had seen end by then); without fair sharing it
    # would be last. Asserted as "not among the flood's last two", which
    # holds however late the test sent it, short of a stall over three of them.
    assert finished.index("quiet") <= FLOOD - 2, (finished, before, fair.log_tail())


async def test_without_fair_sharing_it_waits_behind_the_whole_flood(unfair: Served) -> None:
    # Shorter flood requests: first come, first served needs no margin for a
    # late test (the quiet request is last however late it is sent).
    finished, _ = await completion_order(unfair, tokens=FLOOD_TOKENS // 4)
    # Last, with the whole flood done before it.
    assert finished[-1] == "quiet" and len(finished) == FLOOD + 1, (finished, unfair.log_tail())
