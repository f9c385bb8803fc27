"""Worker addresses: parsing ``--workers`` and resolving host names to one worker per IP."""

from __future__ import annotations

import asyncio

import pytest

from gateway.dispatch.discovery import parse_addresses, resolve


def test_addresses_are_split_and_given_a_scheme() -> None:
    assert parse_addresses("tcp://a:1, b:2,,") == ["tcp://a:1", "tcp://b:2"]


def test_no_address_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_addresses(" , ")


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5550", "tcp://[::1]:5550", "ipc:///tmp/w"])
def test_ip_addresses_and_other_transports_are_kept_as_they_are(address: str) -> None:
    assert asyncio.run(resolve(address)) == [address]


def test_a_host_name_becomes_one_address_per_ip() -> None:
    # localhost resolves on every machine; IPv4 is preferred so that a name
    # listed for both families does not count one worker twice.
    assert asyncio.run(resolve("tcp://localhost:5550")) == ["tcp://127.0.0.1:5550"]


def test_a_name_that_does_not_resolve_yields_no_worker_yet() -> None:
    assert asyncio.run(resolve("tcp://no-such-host.invalid:5550")) == []
