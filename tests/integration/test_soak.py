"""A short soak (loadtest/soak.py) through a keyed gateway in front of the
session's real worker: every kind of request ends as it should."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import soak
from tests.conftest import MODEL, Served, start_gateway, stop_serve


@pytest.fixture
def keyed(served: Served, tmp_path: Path) -> Iterator[Served]:
    keys = soak.keys_file(tmp_path)
    gateway = start_gateway(
        tmp_path / "gateway.log",
        served.worker_addresses(1),
        env={"LLMGATE_API_KEYS_FILE": str(keys)},
    )
    try:
        yield gateway
    finally:
        stop_serve(gateway)


def test_a_short_soak_ends_every_kind_as_it_should(keyed: Served, tmp_path: Path) -> None:
    # Five users: each kind is sent from the first turn on, whatever the machine's speed.
    report = asyncio.run(
        soak.soak(keyed.base_url, MODEL, len(soak.KINDS), 5.0, 1.0, tmp_path, keyed=True)
    )
    assert report["requests_failed"] == {}, (report, keyed.log_tail())
    assert set(report["requests_ok"]) == set(soak.KINDS)  # type: ignore[arg-type]
    statuses = report["limited_key_statuses"]
    assert statuses and set(statuses) <= {"200", "429"}, statuses  # type: ignore[arg-type]
    assert (tmp_path / "soak_samples.csv").exists()
    assert "Traceback" not in keyed.log_path.read_text()
