"""Every route of the table, tried as a hostile caller would: without a key, with a
wrong one, as a tenant on an operator's route, and with another tenant's ids.

The cases are generated from the route table (``shared.routes``): a new route is
tried by construction, and a route with a parameter this suite cannot fill with
another tenant's object fails :func:`test_every_route_parameter_has_an_owned_object`
until it can.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from shared import routes
from shared.routes import Method, Route
from tests.conftest import MODEL
from tests.integration.tenancy.conftest import ADMIN, Tenancy

CALLS = [(route, method) for route in routes.ROUTES for method in route.methods]
# What fills each route parameter: an object alice made.
OWNED = {"file_id": "file", "batch_id": "batch", "response_id": "response"}
LINE = {
    "custom_id": "req-0",
    "method": "POST",
    "url": "/v1/completions",
    "body": {"model": MODEL, "prompt": "Access: one", "max_tokens": 2},
}


def call_id(value: object) -> str:
    if isinstance(value, Route):
        return value.path
    return str(value)


@pytest.fixture(scope="module")
def alices(tenancy: Tenancy) -> Iterator[dict[str, str]]:
    """An object of each kind alice owns: a file, a batch, a stored response."""
    sdk = openai.OpenAI(
        base_url=f"{tenancy.gateways[0].base_url}/v1", api_key=tenancy.key("alice"), max_retries=0
    )
    data = (json.dumps(LINE) + "\n").encode()
    file_id = sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
    batch_id = sdk.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
    ).id
    response = tenancy.client("alice").post(
        "/v1/responses", json={"model": MODEL, "input": "Access: say hi.", "max_output_tokens": 2}
    )
    assert response.status_code == 200, response.text
    yield {"file": file_id, "batch": batch_id, "response": response.json()["id"]}


def path_of(route: Route, ids: dict[str, str]) -> str:
    return route.url(**{param: ids[OWNED[param]] for param in route.params})


def test_every_route_parameter_has_an_owned_object() -> None:
    params = {param for route in routes.ROUTES for param in route.params}
    assert params <= OWNED.keys(), params - OWNED.keys()


@pytest.mark.parametrize(("route", "method"), CALLS, ids=call_id)
def test_no_key_or_a_wrong_key_gets_401_everywhere_but_the_probes(
    tenancy: Tenancy, route: Route, method: Method
) -> None:
    path = route.url(**{param: "x" for param in route.params})
    for gateway in (0, 1):
        for headers in ({}, {"Authorization": "Bearer sk-llmgate-not-a-key"}):
            response = httpx.request(
                method, tenancy.gateways[gateway].base_url + path, headers=headers, timeout=60
            )
            expected = 200 if route.key == "never" else 401
            assert response.status_code == expected, (headers, response.text)
            if expected == 401 and route.dialect == "openai":
                assert response.json()["error"]["code"] == "invalid_api_key"
            elif expected == 401:  # TGI's error body, which its clients read
                assert isinstance(response.json()["error"], str)


@pytest.mark.parametrize(
    ("route", "method"), [(r, m) for r, m in CALLS if r.key == "admin"], ids=call_id
)
def test_a_tenant_on_an_operators_route_gets_403_and_the_operator_gets_it(
    tenancy: Tenancy, route: Route, method: Method
) -> None:
    for gateway in (0, 1):
        tenant = tenancy.client("alice", gateway).request(method, route.path)
        assert tenant.status_code == 403, tenant.text
        operator = tenancy.client(ADMIN, gateway).request(method, route.path)
        assert operator.status_code == 200, operator.text


@pytest.mark.parametrize(("route", "method"), [(r, m) for r, m in CALLS if r.params], ids=call_id)
def test_another_tenants_ids_are_unknown_and_what_they_name_is_untouched(
    tenancy: Tenancy, alices: dict[str, str], route: Route, method: Method
) -> None:
    path = path_of(route, alices)
    for gateway in (0, 1):
        response = tenancy.client("bob", gateway).request(method, path)
        assert response.status_code == 404, response.text
        assert alices[OWNED[route.params[0]]] in response.json()["error"]["message"]
    # Still there, as alice made it (bob's DELETE and cancel did nothing).
    for param in route.params:
        kind = OWNED[param]
        own = {
            "file": routes.FILE,
            "batch": routes.BATCH,
            "response": routes.RESPONSE,
        }[kind]
        check = tenancy.client("alice", 1).get(own.url(**{own.params[0]: alices[kind]}))
        assert check.status_code == 200, check.text
        if kind == "batch":
            assert check.json()["status"] not in ("cancelling", "cancelled")


def test_lists_and_their_cursors_show_a_tenant_only_its_own(
    tenancy: Tenancy, alices: dict[str, str]
) -> None:
    bob = tenancy.client("bob", 1)
    for listing, own in (("/v1/files", "file"), ("/v1/batches", "batch")):
        everything = bob.get(listing)
        assert everything.status_code == 200
        assert alices[own] not in everything.text
        # A cursor naming alice's object pages nothing of hers either.
        after = bob.get(listing, params={"after": alices[own]})
        assert alices[own] not in after.text
        assert after.status_code in (200, 400, 404), after.text
    usage = bob.get("/v1/usage", params={"key": "alice"})
    assert usage.status_code == 400, usage.text


def test_a_response_id_another_tenant_holds_is_refused_and_hers_stays(
    tenancy: Tenancy, alices: dict[str, str]
) -> None:
    response_id = alices["response"]
    before = tenancy.client("alice").get(routes.RESPONSE.url(response_id=response_id)).json()
    body: dict[str, Any] = {
        "model": MODEL,
        "input": "Access: overwrite it.",
        "max_output_tokens": 2,
        "request_id": response_id,
    }
    refused = tenancy.client("bob", 1).post("/v1/responses", json=body)
    assert refused.status_code == 400, refused.text
    after = tenancy.client("alice", 0).get(routes.RESPONSE.url(response_id=response_id))
    assert after.status_code == 200 and after.json() == before


def test_a_name_added_again_with_a_new_secret_owns_nothing_of_the_old_ones(
    tenancy: Tenancy,
) -> None:
    from shared import api_keys

    old = tenancy.known("carol")
    made = tenancy.client("carol").post(
        "/v1/files",
        files={"file": ("in.jsonl", (json.dumps(LINE) + "\n").encode())},
        data={"purpose": "batch"},
    )
    assert made.status_code == 200, made.text
    file_id = made.json()["id"]
    api_keys.revoke(tenancy.keys_file, "carol")
    del tenancy.keys["carol"]
    new = tenancy.known("carol")
    assert new != old
    again = tenancy.client("carol")
    assert again.get(routes.FILE.url(file_id=file_id)).status_code == 404
    assert file_id not in again.get("/v1/files").text
