"""The README's settings tables and its pools example are exactly what the code defines."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared import config, settings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize(
    "cls", [settings.ServeSettings, settings.GatewaySettings, settings.WorkerSettings]
)
def test_settings_table_matches_the_code(cls: type) -> None:
    begin, end = f"<!-- settings:{cls.__name__} -->\n", f"\n<!-- /settings:{cls.__name__} -->"
    assert begin in README, f"no settings table for {cls.__name__} in the README"
    table = README.split(begin, 1)[1].split(end, 1)[0]
    assert table == settings.markdown_table(cls), (
        "README settings table is out of date: regenerate it with "
        "`python -m shared.settings --update README.md`"
    )


def test_the_pools_example_is_the_file_in_examples() -> None:
    """The README's worked config is the one the pools tests run (as printed)."""
    section = README.split("## Many models behind one URL", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert config.parse(block) == config.load(ROOT / "examples" / "two-pools.yaml")
