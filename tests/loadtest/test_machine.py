"""``loadtest.machine``: what a run ran on."""

from __future__ import annotations

from loadtest import machine


def test_a_missing_package_has_an_unknown_version_and_is_left_out() -> None:
    assert machine.package_version("no-such-distribution-here") == "unknown"
    found = machine.installed_versions(["msgspec", "no-such-distribution-here"])
    assert list(found) == ["msgspec"]


def test_the_description_names_the_cores_a_run_used() -> None:
    described = machine.describe([0, 1])
    assert described["cores"] == [0, 1] and described["memory_gib"] > 0
    assert described["cpu"]
    assert set(machine.summary()) == {"platform", "cpu", "cpu_count", "memory_gib"}
