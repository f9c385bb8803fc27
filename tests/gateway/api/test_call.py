"""gateway/api/call.py: one request end to end over a real pool, its workers played by the test.

What the client gets (status, body, stream, headers) and how the request is
counted, when a worker is lost before or after its first output, when the
cascade keeps or escalates the cheap answer, and when the response cache has
the answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.responses import Response
from prometheus_client import REGISTRY
from starlette.requests import Request

from gateway import metrics
from gateway.api.call import Call
from gateway.api.http import EventStream
from gateway.cache import ResponseCache
from gateway.cache.memory import MemoryStore
from gateway.dialects import schemas, sse
from gateway.dispatch.models import Models
from gateway.dispatch.pool import Pool
from gateway.dispatch.workers import Worker
from shared import config, protocol, routes
from shared.settings import GatewaySettings, RoutingSettings
from tests.gateway.api.test_attempts import answer, generated, generates, sent_to
from tests.gateway.test_pool import healthy_worker
from tests.gateway.test_tiers import worker

ROUTE = routes.COMPLETIONS.path


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    running = Pool(routing=RoutingSettings(policy="round-robin"))
    yield running
    running.workers.ctx.term()


def call(pool: Pool, raw: dict[str, Any], cache: ResponseCache | None = None) -> Call:
    """The call for a completion request with body ``raw``, as the route makes it."""
    services = SimpleNamespace(
        pool=pool, settings=GatewaySettings(), cache=cache, limits=None, ledger=None
    )
    app = SimpleNamespace(services=services)
    scope = {"type": "http", "method": "POST", "path": ROUTE, "headers": [], "app": app}

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError

    body = schemas.validate(raw, schemas.CompletionRequest)
    builder = sse.Completion("", body.model, 1, body.logprobs)
    return Call(Request(scope, receive), "completion", ROUTE, raw, body, builder)


def serve(pool: Pool, raw: dict[str, Any], cache: ResponseCache | None = None) -> Any:
    return asyncio.create_task(call(pool, raw, cache).serve(lambda limit: ""))


def counted(status: int, model: str = "m") -> float:
    labels = {"model": model, "route": ROUTE, "status": str(status)}
    metrics.flush()  # the request path's counts are written out in batches
    return REGISTRY.get_sample_value("llmgate_requests_total", labels) or 0.0


def text_of(response: Response) -> str:
    return str(json.loads(response.body)["choices"][0]["text"])


async def test_a_worker_lost_before_any_output_is_retried_and_the_answer_names_the_other(
    pool: Pool,
) -> None:
    a, b = healthy_worker(pool, "a"), healthy_worker(pool, "b")
    before = counted(200)
    task = serve(pool, {"model": "m", "prompt": "The capital of France is"})
    await sent_to(a)
    pool.workers.lose(a, "its connection dropped")
    answer(pool, b, await sent_to(b), " Paris")
    response = await task
    assert response.status_code == 200 and text_of(response) == " Paris"
    assert response.headers["x-llmgate-worker"] == b.address
    assert response.headers["x-llmgate-model"] == "m"
    assert "x-llmgate-pool" not in response.headers  # no config, no pool
    assert counted(200) == before + 1
    assert not pool.pending


async def test_a_stream_whose_worker_is_lost_after_its_first_output_ends_with_an_error(
    pool: Pool,
) -> None:
    a, b = healthy_worker(pool, "a"), healthy_worker(pool, "b")
    before = counted(502)
    task = serve(pool, {"model": "m", "prompt": "Hi", "stream": True})
    rid = await sent_to(a)
    pool.worker_output(a.link, protocol.Deltas(items=[protocol.Delta(rid, 0, "Hel", 1)]))
    response = await task
    assert isinstance(response, EventStream)
    assert response.headers["x-llmgate-worker"] == a.address
    pool.workers.lose(a, "its connection dropped")
    events = [chunk async for chunk in response.body_iterator]
    assert b'"text":"Hel"' in events[0]
    assert b"The stream was cut" in events[1] and events[-1] == sse.DONE
    # Not retried: the client has its first output already.
    assert not generates(b)
    assert counted(502) == before + 1
    assert not pool.pending and a.in_flight == 0


CASCADE = """\
pools:
  - {name: small, served_model_name: cheap}
  - {name: large, served_model_name: big}
auto:
  rules: []
  default: cheap
  cascade: {escalate_to: big, min_mean_logprob: -1.0}
"""


def cascade_pool() -> tuple[Pool, Worker, Worker]:
    pool = Pool(models=Models(config.parse(CASCADE)))
    return pool, worker(pool, "small", "cheap", 4), worker(pool, "large", "big", 4)


async def test_an_unsure_cheap_answer_escalates_and_the_client_gets_the_big_one() -> None:
    pool, cheap, big = cascade_pool()
    task = serve(pool, {"model": "auto", "prompt": "Why?"})
    asked = await generated(cheap)
    assert asked.params["logprobs"] == 0  # asked for, though the client did not
    answer(pool, cheap, asked.request_id, " Dunno", logprob=-3.0)
    escalated = await generated(big)
    assert "logprobs" not in escalated.params  # the client's request, as it came
    answer(pool, big, escalated.request_id, " Because")
    response = await task
    assert text_of(response) == " Because"  # the cheap answer is gone
    assert json.loads(response.body)["choices"][0]["logprobs"] is None
    headers = response.headers
    assert headers["x-llmgate-cascade"] == "escalated" and headers["x-llmgate-route"] == "default"
    assert headers["x-llmgate-model"] == "big" and headers["x-llmgate-pool"] == "large"
    pool.workers.ctx.term()


async def test_a_confident_cheap_answer_is_kept() -> None:
    pool, cheap, big = cascade_pool()
    task = serve(pool, {"model": "auto", "prompt": "Why?"})
    answer(pool, cheap, await sent_to(cheap), " Because", logprob=-0.1)
    response = await task
    assert text_of(response) == " Because"
    assert response.headers["x-llmgate-cascade"] == "accepted"
    assert response.headers["x-llmgate-pool"] == "small"
    assert not generates(big)
    pool.workers.ctx.term()


async def test_a_cached_answer_is_replayed_without_a_worker(pool: Pool) -> None:
    a = healthy_worker(pool, "a")
    cache = ResponseCache(MemoryStore(1 << 20), 60.0, "deterministic", "memory")
    raw = {"model": "m", "prompt": "2+2=", "temperature": 0}
    task = serve(pool, raw, cache)
    answer(pool, a, await sent_to(a), " 4")
    first = await task
    assert first.headers["x-llmgate-cache"] == "miss"
    again = await serve(pool, raw, cache)
    assert again.headers["x-llmgate-cache"] == "hit" and text_of(again) == " 4"
    assert "x-llmgate-worker" not in again.headers  # nobody ran it
    assert again.headers["x-llmgate-model"] == "m"  # as the stored answer said
    assert not generates(a)
    await cache.close()
