"""Priority bands through the real engine: a key's band, a lower one a request asks for
(the ``x-llmgate-band`` header or OpenAI's ``service_tier``), never a higher one, and a
clear 400 for a band that does not exist. Which band goes first under contention is
admission's (tests/gateway/test_admission.py), the same in every process."""

from __future__ import annotations

import pytest

from tests.conftest import MODEL
from tests.integration.tenancy.conftest import Tenancy

BODY = {"model": MODEL, "prompt": "Bands:", "max_tokens": 2, "temperature": 0}
# Computed each time: a response-cache hit runs in no band.
UNCACHED = {"cache-control": "no-cache, no-store"}


@pytest.mark.parametrize(
    ("key", "headers", "extra", "band"),
    [
        ("alice", {}, {}, None),  # interactive: no header
        ("alice", {"x-llmgate-band": "standard"}, {}, "standard"),
        ("alice", {}, {"service_tier": "flex"}, "batch"),
        ("middle", {}, {}, "standard"),
        ("middle", {"x-llmgate-band": "interactive"}, {}, "standard"),  # never higher
        ("middle", {}, {"service_tier": "priority"}, "standard"),
    ],
)
def test_a_request_runs_in_its_keys_band_or_a_lower_one(
    tenancy: Tenancy, key: str, headers: dict[str, str], extra: dict[str, str], band: str | None
) -> None:
    tenancy.known("middle", band="standard")
    answer = tenancy.client(key).post(
        "/v1/completions", json=BODY | extra, headers=UNCACHED | headers
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers.get("x-llmgate-band") == band
    assert answer.json()["usage"]["completion_tokens"] == 2


def test_a_band_that_does_not_exist_is_a_400(tenancy: Tenancy) -> None:
    alice = tenancy.client("alice")
    answer = alice.post("/v1/completions", json=BODY, headers={"x-llmgate-band": "urgent"})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "x-llmgate-band"
    answer = alice.post("/v1/completions", json=BODY | {"service_tier": "gold"})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "service_tier"
