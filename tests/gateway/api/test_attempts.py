"""gateway/api/attempts.py: the retry policy, and attempts run through a real pool.

The workers are test_pool's: links that keep what they are sent, and whose
answers the test delivers through the pool, as a worker's would arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from prometheus_client import REGISTRY

from gateway import errors
from gateway.api.attempts import Attempts, Retries
from gateway.api.failures import retryable
from gateway.api.migration import Seam
from gateway.dialects import sse
from gateway.dispatch.handle import WorkerLost
from gateway.dispatch.models import Target, Tier
from gateway.dispatch.pool import Pool
from gateway.dispatch.workers import Worker
from gateway.tracing import NO_SPAN
from shared import protocol
from shared.settings import RoutingSettings
from tests.gateway.test_pool import healthy_worker

M = Target("m", (Tier("", "m"),))
LOST = WorkerLost("the worker was lost: its connection dropped")
DRAINING = protocol.Failed("r", 503, "The worker is draining.", cause=protocol.WORKER_DRAINING)
SILENT = protocol.Failed("r", 503, "This gateway went silent.", cause=protocol.GATEWAY_SILENT)
BAD = protocol.Failed("r", 400, "The prompt is too long.", param="prompt")


# -- the retry policy ----------------------------------------------------------


def test_a_lost_worker_and_a_503_may_be_retried_and_nothing_else() -> None:
    assert retryable(LOST) and retryable(DRAINING) and retryable(SILENT)
    assert not retryable(BAD)


def test_a_failed_attempt_excludes_its_worker_and_says_why() -> None:
    first = Retries(limit=2)
    after = first.after(LOST, "tcp://a:5550")
    assert after == Retries(2, 1, frozenset({"tcp://a:5550"}), LOST.reason)
    assert first == Retries(2)  # a value: the old state is untouched
    with pytest.raises(AttributeError, match="immutable"):
        after.failures = 0  # type: ignore[misc]


def test_a_worker_that_dropped_a_silent_gateways_request_may_run_it_again() -> None:
    after = Retries(limit=2).after(SILENT, "tcp://a:5550")
    assert after.failures == 1 and not after.tried


def test_past_the_limit_the_request_fails_with_the_last_reason() -> None:
    once = Retries(limit=1).after(DRAINING, "tcp://a:5550")
    with pytest.raises(errors.UpstreamFailed, match="failed 2 times; last: the worker was lost"):
        once.after(LOST, "tcp://b:5550")


def test_no_worker_left_names_why_the_last_one_failed() -> None:
    refused = errors.NoWorker("No other worker for model `m` is available.")
    assert Retries(limit=2).no_worker(refused) is refused
    after = Retries(limit=2).after(LOST, "tcp://a:5550")
    assert after.no_worker(refused).message.endswith(f"The worker that had it: {LOST.reason}.")


# -- attempts through the pool -------------------------------------------------


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    running = Pool(routing=RoutingSettings(policy="round-robin"))
    yield running
    running.workers.ctx.term()


def attempts(pool: Pool, max_retries: int = 2, recorded: list[Any] | None = None) -> Attempts:
    builder = sse.Completion("req", "m", 1, None)
    return Attempts(pool, "req", "completion", 0.0, None, builder, NO_SPAN, max_retries, recorded)


def generates(worker: Worker) -> list[protocol.Generate]:
    sent = worker.link.sent  # type: ignore[attr-defined]
    return [m for m in sent if isinstance(m, protocol.Generate)]


async def generated(worker: Worker) -> protocol.Generate:
    """The next request the pool sends ``worker`` (what was sent before is forgotten)."""
    for _ in range(100):
        sent = generates(worker)
        if sent:
            worker.link.sent.clear()  # type: ignore[attr-defined]
            return sent[-1]
        await asyncio.sleep(0)
    raise AssertionError(f"nothing was sent to {worker.address}")


async def sent_to(worker: Worker) -> str:
    """The wire id of the next request the pool sends ``worker``."""
    return (await generated(worker)).request_id


def answer(pool: Pool, worker: Worker, rid: str, *texts: str, logprob: float | None = None) -> None:
    """``worker`` sends ``texts`` for ``rid`` (each one token, of ``logprob`` if
    given), the last one finished, then the usage that ends the request."""
    items = []
    for i, text in enumerate(texts):
        tokens = (
            [protocol.TokenLogprob(token=text, logprob=logprob)] if logprob is not None else None
        )
        finish = "stop" if i == len(texts) - 1 else None
        items.append(protocol.Delta(rid, 0, text, 1, finish_reason=finish, logprobs=tokens))
    items.append(protocol.Delta(rid, 0, usage=protocol.Usage(3, len(texts))))
    pool.worker_output(worker.link, protocol.Deltas(items=items))


def retries(reason: str) -> float:
    return REGISTRY.get_sample_value("llmgate_retries_total", {"reason": reason}) or 0.0


async def test_a_worker_lost_before_its_output_is_retried_on_another(pool: Pool) -> None:
    a, b = healthy_worker(pool, "a"), healthy_worker(pool, "b")
    run = attempts(pool)
    before = retries("worker_lost")
    task = asyncio.create_task(run.run(M, {"prompt": "hi"}))
    first = await sent_to(a)
    pool.worker_output(a.link, protocol.Deltas(items=[protocol.Delta(first, 0, "lost", 1)]))
    pool.workers.lose(a, "its connection dropped")
    second = await sent_to(b)
    assert second != first  # the retry's own id on the wire
    answer(pool, b, second, "Par", "is")
    answered_by, usage = await task
    assert answered_by.address == b.address and usage == protocol.Usage(3, 2)
    # What the lost worker sent before it went is forgotten.
    assert "".join(run.builder.choices[0].text) == "Paris"
    assert retries("worker_lost") == before + 1
    assert not pool.pending and a.in_flight == b.in_flight == 0


async def test_a_failure_that_is_the_requests_own_is_not_retried(pool: Pool) -> None:
    a, b = healthy_worker(pool, "a"), healthy_worker(pool, "b")
    task = asyncio.create_task(attempts(pool).run(M, {}))
    rid = await sent_to(a)
    pool.worker_output(a.link, msgspec.structs.replace(BAD, request_id=rid))
    with pytest.raises(errors.BadRequest) as refused:
        await task
    assert refused.value.param == "prompt"
    assert not generates(b)


async def test_a_draining_worker_refusal_goes_to_another_and_then_gives_up(pool: Pool) -> None:
    workers = [healthy_worker(pool, name) for name in ("a", "b")]
    task = asyncio.create_task(attempts(pool, max_retries=1).run(M, {}))
    for worker in workers:
        rid = await sent_to(worker)
        pool.worker_output(worker.link, msgspec.structs.replace(DRAINING, request_id=rid))
    with pytest.raises(errors.UpstreamFailed, match="failed 2 times"):
        await task


async def test_when_no_other_worker_is_left_the_503_says_what_happened(pool: Pool) -> None:
    a = healthy_worker(pool, "a")
    task = asyncio.create_task(attempts(pool).run(M, {}))
    rid = await sent_to(a)
    pool.worker_output(a.link, msgspec.structs.replace(DRAINING, request_id=rid))
    with pytest.raises(errors.NoWorker, match="The worker that had it: The worker is draining"):
        await task


async def test_a_stream_starts_at_its_first_delta_and_is_then_the_workers_to_finish(
    pool: Pool,
) -> None:
    a = healthy_worker(pool, "a")
    task = asyncio.create_task(attempts(pool).start(M, {"stream": True}))
    rid = await sent_to(a)
    pool.worker_output(a.link, msgspec.structs.replace(SILENT, request_id=rid))
    rid = await sent_to(a)  # a gateway gone silent: the same worker may take it again
    pool.worker_output(a.link, protocol.Deltas(items=[protocol.Delta(rid, 0, "Hel", 1)]))
    handle, first = await task
    assert first.text == "Hel" and handle.answered_by.address == a.address
    # From now on the request cannot be retried: a stalled worker is waited for.
    assert pool.pending[rid].delivery.streaming
    assert pool.worker_lost(a, "silent", may_return=True) == ([], 1)
    handle.close()
    assert not pool.pending and a.in_flight == 0


async def test_output_recorded_for_the_cache_is_forgotten_with_the_attempt(pool: Pool) -> None:
    a, b = healthy_worker(pool, "a"), healthy_worker(pool, "b")
    recorded: list[protocol.Delta] = []
    task = asyncio.create_task(attempts(pool, recorded=recorded).run(M, {}))
    rid = await sent_to(a)
    pool.worker_output(a.link, protocol.Deltas(items=[protocol.Delta(rid, 0, "gone", 1)]))
    pool.workers.lose(a, "its connection dropped")
    rid = await sent_to(b)
    answer(pool, b, rid, "kept")
    await task
    assert [d.text for d in recorded] == ["kept"]


async def test_a_whole_request_that_moved_is_billed_what_both_workers_made(pool: Pool) -> None:
    """Cut after its move (the client left), it is billed the prompt once, the
    tokens it carried and those the next worker made: not the last worker's
    count alone."""
    a, b = healthy_worker(pool, "a"), healthy_worker(pool, "b")
    run = attempts(pool)
    raw = {"prompt": "hi"}

    async def resume(carried: protocol.Continuation, failed: str) -> Any:
        return await run.start(M, raw, carried, frozenset({failed}), movable=True)

    task = asyncio.create_task(run.run(M, raw, lambda: Seam(2, resume)))
    rid = await sent_to(a)
    pool.worker_output(
        a.link,
        protocol.Deltas(
            items=[
                protocol.Delta(rid, 0, "Pa", 1, prompt_tokens=3, token_ids=[5]),
                protocol.Delta(rid, 0, "ris", 1, token_ids=[6]),
            ]
        ),
    )
    pool.workers.lose(a, "its connection dropped")
    moved = await generated(b)
    assert moved.continuation == protocol.Continuation([5, 6], len("Paris"))
    pool.worker_output(
        b.link,
        protocol.Deltas(
            # The next worker counts the prompt without the carried tokens.
            items=[protocol.Delta(moved.request_id, 0, " is", 1, prompt_tokens=3, token_ids=[7])]
        ),
    )
    for _ in range(100):
        if "".join(run.builder.choices[0].text) == "Paris is":
            break
        await asyncio.sleep(0)
    assert "".join(run.builder.choices[0].text) == "Paris is"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert run.computed() == protocol.Usage(3, 3)
