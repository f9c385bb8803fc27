"""Per-key limits end to end: two gateway processes sharing one real Redis
(``--limits``) and one keys file, in front of the session's real worker.

Between them the two admit exactly a key's limit (requests and tokens); a
client sees OpenAI's rate-limit headers and its 429 (through the OpenAI SDK
too); a key's model scope holds; a key revoked in the file is refused by
both within seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from shared import api_keys
from tests.conftest import MODEL, Served, gateway_pair
from tests.harness.redis_server import RedisServer

# Token-id prompts of 9 tokens and max_tokens 1: the gateway reserves exactly
# what the worker reports (9 + 1), so settling moves nothing.
PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8, 9]
COST = len(PROMPT_IDS) + 1


class Keys:
    """The keys file, and the secrets ``llmgate keys add`` gave for it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.secrets: dict[str, str] = {}

    def add(self, name: str, **limits: Any) -> None:
        self.secrets[name] = api_keys.add(self.path, name, **limits)

    def auth(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secrets[name]}"}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    keys = Keys(tmp_path_factory.mktemp("limits-keys") / "keys.yaml")
    keys.add("rpm", requests_per_minute=6)
    keys.add("tpm", tokens_per_minute=5 * COST)
    keys.add("sdk", requests_per_minute=2, tokens_per_minute=10_000)
    keys.add("scoped", models=["another-model"])
    keys.add("leaving")
    return keys


@pytest.fixture(scope="module")
def two_gateways(
    served: Served,
    redis_server: RedisServer,
    keys: Keys,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Served, Served]]:
    directory = tmp_path_factory.mktemp("limits-gateways")
    flags = ("--limits", redis_server.url, "--api-keys-file", str(keys.path))
    with gateway_pair(served, directory, *flags) as both:
        yield both


def completion(gateway: Served, headers: dict[str, str], prompt: Any = "Hi") -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    return httpx.post(f"{gateway.base_url}/v1/completions", json=body, headers=headers, timeout=120)


def spread(
    two: tuple[Served, Served], headers: dict[str, str], prompt: Any
) -> tuple[list[httpx.Response], float]:
    """Ten requests at once, alternating between the two gateways, and the
    seconds from the first sent to the last answered (every admission falls
    in that span)."""
    started = time.monotonic()
    with ThreadPoolExecutor(10) as threads:
        responses = list(threads.map(lambda i: completion(two[i % 2], headers, prompt), range(10)))
    return responses, time.monotonic() - started


def most_admitted(limit: int, unit_seconds: float, span: float) -> int:
    """What a token bucket of ``limit`` that earns a unit back every
    ``unit_seconds`` may admit in ``span`` seconds: the limit, plus the units
    earned meanwhile (none, unless the machine took that long to send ten
    requests; then the count is bounded, not exact)."""
    return limit + int(span // unit_seconds)


def assert_rate_limited(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert "Rate limit reached for the API key" in error["message"]


def test_two_gateways_admit_a_keys_requests_per_minute_between_them(
    two_gateways: tuple[Served, Served], keys: Keys
) -> None:
    responses, span = spread(two_gateways, keys.auth("rpm"), "Hi")
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code != 200]
    # 6 a minute: a request back every 10 s.
    assert 6 <= len(ok) <= most_admitted(6, 10.0, span), ([r.status_code for r in responses], span)
    for response in limited:
        assert_rate_limited(response)
        assert response.headers["x-ratelimit-remaining-requests"] == "0"
    for response in ok:
        assert response.headers["x-ratelimit-limit-requests"] == "6"
    if len(ok) == 6:
        remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok)
        assert remaining == list(range(6))


def test_two_gateways_admit_a_keys_tokens_per_minute_between_them(
    two_gateways: tuple[Served, Served], keys: Keys
) -> None:
    responses, span = spread(two_gateways, keys.auth("tpm"), PROMPT_IDS)
    ok = [r for r in responses if r.status_code == 200]
    # 5 requests' tokens a minute: one request's worth back every 12 s.
    assert 5 <= len(ok) <= most_admitted(5, 12.0, span), ([r.status_code for r in responses], span)
    for response in ok:
        assert response.json()["usage"]["total_tokens"] == COST  # what was reserved
        assert response.headers["x-ratelimit-limit-tokens"] == str(5 * COST)
    for response in responses:
        if response.status_code != 200:
            assert_rate_limited(response)
            assert "on tokens per min (TPM)" in response.json()["error"]["message"]


def test_the_openai_sdk_sees_the_headers_and_the_429(
    two_gateways: tuple[Served, Served], keys: Keys
) -> None:
    first, second = two_gateways
    client = openai.OpenAI(
        base_url=f"{first.base_url}/v1", api_key=keys.secrets["sdk"], max_retries=0
    )
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
    assert raw.headers["x-ratelimit-limit-tokens"] == "10000"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 10_000
    assert raw.parse().choices
    # A stream has them at its start; the second gateway counts the same key.
    stream_body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "stream": True}
    with httpx.stream(
        "POST",
        f"{second.base_url}/v1/completions",
        json=stream_body,
        headers=keys.auth("sdk"),
        timeout=120,
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["x-ratelimit-remaining-requests"] == "0"
        assert "[DONE]" in stream.read().decode()
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert caught.value.code == "rate_limit_exceeded"
    assert int(caught.value.response.headers["retry-after"]) >= 1
    assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_key_limited_to_another_model_gets_403(
    two_gateways: tuple[Served, Served], keys: Keys
) -> None:
    client = openai.OpenAI(
        base_url=f"{two_gateways[0].base_url}/v1", api_key=keys.secrets["scoped"], max_retries=0
    )
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert caught.value.code == "model_not_allowed"


def test_a_revoked_key_is_refused_by_both_gateways_within_5_s(
    two_gateways: tuple[Served, Served], keys: Keys
) -> None:
    headers = keys.auth("leaving")
    for gateway in two_gateways:
        assert httpx.get(f"{gateway.base_url}/v1/models", headers=headers, timeout=60).is_success
    api_keys.revoke(keys.path, "leaving")
    deadline = time.monotonic() + 5  # the requirement: refused within 5 s
    waiting = list(two_gateways)
    while waiting:
        gateway = waiting[0]
        response = httpx.get(f"{gateway.base_url}/v1/models", headers=headers, timeout=5)
        if response.status_code == 401:
            waiting.pop(0)
            continue
        assert response.status_code == 200, response.text
        assert time.monotonic() < deadline, f"{gateway.base_url} still takes the revoked key"
        time.sleep(0.1)
