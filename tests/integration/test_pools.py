"""Many models behind one URL, real engines: ``llmgate serve --config examples/two-pools.yaml``.

The worked example of docs/models.md, as printed: the embedded model in bfloat16
(pool ``small``, 4 slots, core 0) and in float32 (pool ``large``, tier 2 and
the small pool's substitute, core 1). Names, aliases, ``auto`` rules,
cascade and spill-over, each checked through the response headers that say
who answered. Slow: two more engines start for this module. And a lone
gateway in front of the session's worker whose config declares a second pool
with no worker up yet: its names are a 503 with ``Retry-After``, not a 404.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from shared.embedded import default_model_dir
from shared.ports import free_port
from tests.conftest import (
    MODEL,
    ROOT,
    Served,
    launch_serve,
    launched_ahead,
    module_system,
    start_gateway,
    stop_serve,
)
from tests.harness import prestart
from tests.integration.lora import write_zero_lora
from tests.integration.test_pool import metric
from tests.integration.test_prompt_tokens import described

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "two-pools.yaml"


LORA = "smollm2-zero-lora"


# This module's system starts while the module before it runs (tests/harness/prestart.py).
SYSTEM_FIXTURE = "pools"


def launch_system(directory: Path) -> prestart.Launched:
    adapter = write_zero_lora(directory / "lora", str(default_model_dir()))
    # Flags after the config go to every worker: both pools serve the adapter.
    lora = ("--lora-modules", f"{LORA}={adapter}", "--max-lora-rank", "8")
    running = launch_serve(directory / "serve.log", "--config", str(EXAMPLE), *lora, num_workers=2)
    return launched_ahead(running)


@pytest.fixture(scope="module")
def pools(request: pytest.FixtureRequest) -> Iterator[Served]:
    with module_system(prestart.take(request)) as running:
        yield running


def post(served: Served, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    response = httpx.post(
        f"{served.base_url}/v1/completions", json=body, headers=headers, timeout=120
    )
    assert response.status_code == 200, response.text
    return response


def test_the_model_list_shows_both_pools_the_aliases_and_auto(pools: Served) -> None:
    listed = {
        m["id"]: m for m in httpx.get(f"{pools.base_url}/v1/models", timeout=60).json()["data"]
    }
    assert {"smollm2-bf16", "smollm2-f32", "fast", "accurate", "auto"} <= listed.keys()
    assert listed["fast"]["alias_for"] == "smollm2-bf16"
    assert listed["accurate"]["alias_for"] == "smollm2-f32"
    assert "alias_for" not in listed["smollm2-f32"]
    assert set(listed["auto"]["routes_to"]) == {"fast", "accurate"}
    # The OpenAI SDK reads the list as it reads OpenAI's.
    client = openai.OpenAI(base_url=f"{pools.base_url}/v1", api_key="none")
    assert {"smollm2-bf16", "fast", "auto"} <= {m.id for m in client.models.list()}


@pytest.mark.parametrize(
    ("asked", "served", "pool"),
    [
        ("smollm2-f32", "smollm2-f32", "large"),
        ("smollm2-bf16", "smollm2-bf16", "small"),
        ("fast", "smollm2-bf16", "small"),
        ("accurate", "smollm2-f32", "large"),
    ],
)
def test_a_name_or_alias_lands_on_its_pool(
    pools: Served, asked: str, served: str, pool: str
) -> None:
    response = post(pools, {"model": asked, "prompt": "The capital of France is", "max_tokens": 4})
    assert response.headers["x-llmgate-model"] == served
    assert response.headers["x-llmgate-pool"] == pool
    assert response.json()["model"] == asked  # as OpenAI: the name the client used
    assert response.json()["choices"][0]["text"].strip()


def test_a_stream_says_who_answers_too(pools: Served) -> None:
    body = {"model": "accurate", "prompt": "Hi", "max_tokens": 4, "stream": True}
    url = f"{pools.base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["x-llmgate-model"] == "smollm2-f32"
        assert "data: [DONE]" in response.read().decode()


@pytest.mark.parametrize(
    ("body", "headers", "rule", "served"),
    [
        ({"prompt": "Hi"}, {"x-llmgate-tier": "expensive"}, "asked-for-accuracy", "smollm2-f32"),
        ({"prompt": "word " * 300}, {}, "long-prompt", "smollm2-f32"),
        (
            {"prompt": "Hi", "response_format": {"type": "json_object"}},
            {},
            "structured",
            "smollm2-f32",
        ),
        ({"prompt": "Hi", "stream": False, "temperature": 0}, {}, "default", None),
    ],
)
def test_auto_routes_by_the_configs_rules(
    pools: Served, body: dict, headers: dict[str, str], rule: str, served: str | None
) -> None:
    response = post(pools, {"model": "auto", "max_tokens": 4, **body}, headers)
    assert response.headers["x-llmgate-route"] == rule
    if served is not None:
        assert response.headers["x-llmgate-model"] == served
        assert "x-llmgate-cascade" not in response.headers  # only the default route cascades
    assert response.json()["model"] == "auto"


def test_a_confident_cheap_answer_is_kept(pools: Served) -> None:
    before = metric(pools.base_url, "llmgate_cascade_total", outcome="accepted") or 0
    response = post(
        pools,
        {"model": "auto", "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0},
    )
    assert response.headers["x-llmgate-cascade"] == "accepted"
    assert response.headers["x-llmgate-model"] == "smollm2-bf16"
    assert "Paris" in response.json()["choices"][0]["text"]
    # Logprobs were asked for the cascade's sake, not shown: the client did not ask.
    assert response.json()["choices"][0]["logprobs"] is None
    assert metric(pools.base_url, "llmgate_cascade_total", outcome="accepted") == before + 1


def test_an_unsure_cheap_answer_escalates(pools: Served) -> None:
    before = metric(pools.base_url, "llmgate_cascade_total", outcome="escalated") or 0
    # Sampled far from the model's own choices (temperature 2): its tokens'
    # logprobs are low, well under the example's -1.0.
    body = {"model": "auto", "prompt": "zq xv", "max_tokens": 8, "temperature": 2.0, "seed": 7}
    response = post(pools, body)
    assert response.headers["x-llmgate-cascade"] == "escalated"
    assert response.headers["x-llmgate-model"] == "smollm2-f32"
    assert response.headers["x-llmgate-route"] == "default"
    assert metric(pools.base_url, "llmgate_cascade_total", outcome="escalated") == before + 1


def test_a_lora_adapter_the_workers_serve_is_a_model_of_its_own(pools: Served) -> None:
    listed = {m["id"] for m in httpx.get(f"{pools.base_url}/v1/models", timeout=60).json()["data"]}
    assert LORA in listed
    body = {"model": LORA, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    response = post(pools, body)
    assert response.headers["x-llmgate-model"] == LORA
    assert response.json()["model"] == LORA
    # Its B matrices are zero: it answers as the base model of the pool that ran it.
    base = "smollm2-f32" if response.headers["x-llmgate-pool"] == "large" else "smollm2-bf16"
    plain = post(pools, {**body, "model": base})
    assert response.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_a_worker_names_its_adapter_for_the_kv_index(pools: Served) -> None:
    """A worker gives a gateway its adapter's tokenizer (the base model's) with the
    name its engine's KV events carry for the adapter's blocks (vLLM's
    ``lora_name``, the adapter's ``--lora-modules`` name): the kv policy keys
    the adapter's prompts apart from the base model's."""
    adapter = described(pools, LORA)
    assert adapter.model == LORA and adapter.lora == LORA
    base = described(pools, "smollm2-bf16")
    assert base.lora == ""
    assert adapter.tokenizer_json == base.tokenizer_json


def test_an_unknown_model_is_a_404(pools: Served) -> None:
    response = httpx.post(
        f"{pools.base_url}/v1/completions", json={"model": "gpt-9", "prompt": "Hi"}, timeout=30
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


# A pool with its worker (the session's) and one whose worker is not up: no
# worker listens at its address, so it is "still starting" for as long as the
# test needs, with no race against a real start.
STARTING = """\
pools:
  - {{name: up, served_model_name: {model}, addresses: ["{up}"]}}
  - {{name: starting, served_model_name: later-model, addresses: ["{starting}"]}}
aliases:
  now: {model}
  soon: later-model
auto:
  rules:
    - {{name: up, headers: {{x-llmgate-tier: up}}, use: now}}
  default: soon
"""


@pytest.fixture(scope="module")
def starting(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("starting")
    config = directory / "pools.yaml"
    address = served.worker_addresses()
    config.write_text(
        STARTING.format(model=MODEL, up=address, starting=f"tcp://127.0.0.1:{free_port()}")
    )
    gateway = start_gateway(directory / "gateway.log", address, "--config", str(config))
    try:
        yield gateway
    finally:
        stop_serve(gateway)


@pytest.mark.parametrize("model", ["later-model", "soon", "auto"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_declared_model_whose_pool_is_starting_is_a_503_not_a_404(
    starting: Served, model: str, path: str
) -> None:
    """Regression: the alias of a pool whose worker was still starting answered
    404 "does not exist" while another pool's worker was up."""
    body = {"model": model, "max_tokens": 4}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    response = httpx.post(f"{starting.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "5"
    error = response.json()["error"]
    assert error["code"] == "model_not_ready" and error["param"] == "model"
    assert "`later-model` is not ready: it is starting" in error["message"]


def test_a_starting_model_is_a_503_in_tgis_shape_on_tgis_routes(starting: Served) -> None:
    body = {"inputs": "Hi", "model": "soon", "parameters": {"max_new_tokens": 4}}
    response = httpx.post(f"{starting.base_url}/generate", json=body, timeout=60)
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "5"
    assert response.json()["error_type"] == "unhealthy"
    assert "is starting" in response.json()["error"]


def test_the_openai_sdk_sees_a_retryable_503_for_a_starting_model(starting: Served) -> None:
    client = openai.OpenAI(base_url=f"{starting.base_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model="soon", prompt="Hi", max_tokens=4)
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "5"


def test_beside_a_starting_pool_the_pool_that_is_up_answers_and_unknown_names_are_404(
    starting: Served,
) -> None:
    url = f"{starting.base_url}/v1/completions"
    for model, headers in ((MODEL, {}), ("now", {}), ("auto", {"x-llmgate-tier": "up"})):
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4}
        response = httpx.post(url, json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers["x-llmgate-pool"] == "up"
    unknown = httpx.post(url, json={"model": "gpt-9", "prompt": "Hi"}, timeout=60)
    assert unknown.status_code == 404, unknown.text
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert "retry-after" not in unknown.headers


async def test_a_burst_beyond_the_small_pools_slots_spills_to_tier_2(pools: Served) -> None:
    labels = {"from_pool": "small", "to_pool": "large"}
    before = metric(pools.base_url, "llmgate_spillover_total", **labels) or 0
    # 12 requests at once for the small pool's 4 slots; each runs long enough
    # (64 tokens, no early stop) that the first 4 still hold their slots.
    body = {"model": "fast", "prompt": "Count:", "max_tokens": 64, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=pools.base_url, timeout=300) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(12))
        )
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    by_pool = [r.headers["x-llmgate-pool"] for r in responses]
    assert by_pool.count("small") >= 1 and by_pool.count("large") >= 1, by_pool
    for response in responses:
        expected = (
            "smollm2-f32" if response.headers["x-llmgate-pool"] == "large" else "smollm2-bf16"
        )
        assert response.headers["x-llmgate-model"] == expected
        assert response.json()["usage"]["completion_tokens"] == 64
    spilled = metric(pools.base_url, "llmgate_spillover_total", **labels)
    assert spilled == before + by_pool.count("large")
