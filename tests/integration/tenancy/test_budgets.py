"""A key's daily token budget under a race: 64 requests at once through two gateways
sharing Redis, in front of the real engine. The budget admits what fits, refuses the
rest with OpenAI's ``insufficient_quota``, and ends at exactly what the engine counted
for the answers it let through, never past the budget: each request reserved at least
what it could cost (``gateway.tenants.costs.prompt_bound``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import httpx

from gateway.tenants.costs import prompt_bound
from shared import api_keys
from tests.conftest import MODEL
from tests.integration.tenancy.conftest import ADMIN, Tenancy
from tests.integration.test_pool import wait_for

BUDGET = 300  # tokens a day: about a quarter of the race's reservations
MAX_TOKENS = 16
RACERS = 64
BODY = {
    "model": MODEL,
    "prompt": "Budget race: count to ten.",
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
    "ignore_eos": True,
}


async def race(tenancy: Tenancy, key: str) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {key}"}
    clients = [
        httpx.AsyncClient(base_url=gateway.base_url, headers=headers, timeout=300)
        for gateway in tenancy.gateways
    ]
    try:
        return await asyncio.gather(
            *(clients[i % 2].post("/v1/completions", json=BODY) for i in range(RACERS))
        )
    finally:
        for client in clients:
            await client.aclose()


def budget_of(tenancy: Tenancy, name: str) -> dict[str, Any]:
    answer = tenancy.client(ADMIN).get("/v1/usage", params={"key": name}).json()
    (budget,) = [row for row in answer["budgets"] if row["key"] == name]
    return dict(budget)


def test_a_budget_race_over_two_gateways_never_passes_the_budget(
    tenancy: Tenancy,
) -> None:
    key = tenancy.known("racer", budget={"tokens_per_day": BUDGET})
    answers = asyncio.run(race(tenancy, key))
    statuses = sorted({answer.status_code for answer in answers})
    assert statuses == [200, 429], [a.text for a in answers if a.status_code not in (200, 429)]
    refused = [answer for answer in answers if answer.status_code == 429]
    for answer in refused:
        error = answer.json()["error"]
        assert (error["code"], error["type"]) == ("insufficient_quota", "insufficient_quota")
        assert "tokens_per_day" in error["message"]
        assert 0 < int(answer.headers["retry-after"]) <= 24 * 3600
    # Every token the engine computed for an answer it gave is counted once:
    # settled (in Redis, in the background) once each request has ended.
    computed = sum(a.json()["usage"]["total_tokens"] for a in answers if a.status_code == 200)
    wait_for(
        lambda: budget_of(tenancy, "racer")["spent"] == computed,
        60,
        show=lambda: (
            f"the engine computed {computed}; the budget shows {budget_of(tenancy, 'racer')}"
        ),
    )
    budget = budget_of(tenancy, "racer")
    assert (budget["budget"], budget["limit"]) == ("tokens_per_day", BUDGET)
    assert budget["spent"] == computed
    reservation = prompt_bound(BODY) + MAX_TOKENS
    print(
        f"budget race: spent {budget['spent']} of {BUDGET}; "
        f"{len(refused)} of {RACERS} refused; one reservation {reservation}"
    )
    assert budget["spent"] <= BUDGET
    assert budget["remaining"] == max(BUDGET - budget["spent"], 0)
    # An operator reads the same spend with the keys file.
    assert f"tokens per day {BUDGET} (spent {computed})" in keys_list(tenancy, "racer")


def keys_list_argv(tenancy: Tenancy) -> list[str]:
    return [sys.executable, "-m", "shared.cli", "keys", "list", "--file", str(tenancy.keys_file)]


def keys_list(tenancy: Tenancy, name: str) -> str:
    """``llmgate keys list --gateway``'s line for ``name``, as an operator runs it."""
    listed = subprocess.run(
        [*keys_list_argv(tenancy), "--gateway", tenancy.gateways[1].base_url],
        env={**os.environ, api_keys.ADMIN_KEY_ENV: tenancy.keys[ADMIN]},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (line,) = [row for row in listed.stdout.splitlines() if row.startswith(f"{name}\t")]
    return line


def test_keys_list_without_an_admin_key_says_what_it_needs(tenancy: Tenancy) -> None:
    listed = subprocess.run(
        [*keys_list_argv(tenancy), "--gateway", tenancy.gateways[0].base_url],
        env={k: v for k, v in os.environ.items() if k != api_keys.ADMIN_KEY_ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 2
    assert api_keys.ADMIN_KEY_ENV in listed.stderr
