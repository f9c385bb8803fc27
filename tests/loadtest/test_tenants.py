"""loadtest/tenants.py: its keys file loads, its report prints, the scenario is offered."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from loadtest import loadtest, tenants
from shared import api_keys


def test_the_keys_file_names_the_flooder_and_the_trickle(tmp_path: Path) -> None:
    entries = api_keys.load(str(tenants.keys_file(tmp_path)))
    assert [e.name for e in entries] == ["flooder", "trickle", "operator"]
    assert all(e.band == "interactive" for e in entries)
    assert [e.admin for e in entries] == [False, False, True]  # it reads /metrics
    assert entries[0].key_sha256 == api_keys.sha256_hex(tenants.FLOODER_KEY)


def test_the_report_is_a_table_and_its_markdown() -> None:
    phases = [
        tenants.Phase("alone", True, 0, 20, 0, 80.0, 120.0, 300.0, 400.0, None, 30.0),
        tenants.Phase("fair", True, 64, 20, 0, 900.0, 2000.0, 1500.0, 2600.0, 50.0, 31.0),
        tenants.Phase("fifo", False, 64, 19, 1, 30000.0, None, 31000.0, None, 55.0, 70.0),
    ]
    report = {
        "slots": 8,
        "flood_users": 64,
        "flood_tokens": 128,
        "trickle_requests": 20,
        "trickle_interval_s": 1.5,
        "trickle_tokens": 16,
        "phases": [asdict(p) for p in phases],
    }
    text = tenants.format_report(report)
    assert "| fifo | off | 64 | 30000 | - |" in text
    assert "| 1/20 |" in text
    assert text.splitlines()[1].startswith("phase")


def test_the_scenario_and_its_flags_are_offered() -> None:
    args = loadtest.build_parser().parse_args(["--scenario", "tenants", "--flood-users", "16"])
    assert (args.scenario, args.flood_users, args.tenant_slots) == ("tenants", 16, 8)
