"""The hostile-tenant suite's system: two gateway processes sharing Redis (limits, the
response cache) and PostgreSQL (files, batches, stored responses, usage), a YAML keys
file, in front of the session's real worker."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from shared import api_keys
from tests.conftest import Served, gateway_pair
from tests.harness.postgres_server import PostgresServer
from tests.harness.redis_server import RedisServer
from tests.integration.test_pool import wait_for

# The tenants, and an operator.
TENANTS = ("alice", "bob")
ADMIN = "ops"


@dataclass
class Tenancy:
    gateways: tuple[Served, Served]
    keys_file: Path
    keys: dict[str, str] = field(default_factory=dict)

    def key(self, name: str, **limits: int) -> str:
        """The secret of the key ``name``, added to the file the first time it is asked
        for (the gateways re-read the file within a second: :meth:`known` waits)."""
        if name not in self.keys:
            self.keys[name] = api_keys.add(self.keys_file, name, **limits)
        return self.keys[name]

    def known(self, name: str, **limits: int) -> str:
        """The key ``name`` (added if new), once both gateways take it."""
        key = self.key(name, **limits)
        for gateway in (0, 1):
            http = self.client(name, gateway)
            wait_for(lambda http=http: http.get("/v1/models").status_code == 200, 60)
        return key

    def client(self, name: str | None, gateway: int = 0) -> httpx.Client:
        headers = {} if name is None else {"Authorization": f"Bearer {self.key(name)}"}
        return httpx.Client(base_url=self.gateways[gateway].base_url, headers=headers, timeout=120)


@pytest.fixture(scope="package")
def tenancy(
    served: Served,
    redis_server: RedisServer,
    postgres_server: PostgresServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Tenancy]:
    directory = tmp_path_factory.mktemp("tenancy")
    keys_file = directory / "keys.yaml"
    system = Tenancy((served, served), keys_file)  # the gateways come below
    for name in TENANTS:
        system.key(name)
    system.keys[ADMIN] = api_keys.add(keys_file, ADMIN, admin=True)
    database = postgres_server.create_database("tenancy")
    flags = (
        *("--api-keys-file", str(keys_file)),
        *("--limits", redis_server.url),
        *("--cache", redis_server.url),
        *("--state-db", database),
    )
    with gateway_pair(
        served, directory, *flags, each=lambda name: ("--state-dir", str(directory / name))
    ) as pair:
        system.gateways = pair
        yield system
