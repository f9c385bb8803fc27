"""loadtest/hop_cpu.py: the gateway's CPU per request, measured in-process."""

from __future__ import annotations

import re

import pytest

from loadtest import hop_cpu


def test_it_measures_this_checkouts_gateway_over_a_fake_worker(
    capsys: pytest.CaptureFixture[str],
) -> None:
    hop_cpu.main(["--requests", "400", "--concurrency", "4", "--rounds", "1"])
    out = capsys.readouterr().out
    found = re.search(r"this +CPU per request +([\d.]+) us .* ([\d,]+) requests/s", out)
    assert found is not None, out
    assert float(found.group(1)) > 0 and int(found.group(2).replace(",", "")) > 0
