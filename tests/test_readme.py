"""The documentation's settings tables and its pools example are exactly what the code defines.

Both live in ``docs/`` (the README links there): the tables in
``docs/settings.md``, the worked pools config in ``docs/models.md``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shared import config, settings

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_PAGE = ROOT / "docs" / "settings.md"
MODELS_PAGE = ROOT / "docs" / "models.md"


@pytest.mark.parametrize(
    "cls", [settings.ServeSettings, settings.GatewaySettings, settings.WorkerSettings]
)
def test_settings_table_matches_the_code(cls: type) -> None:
    page = SETTINGS_PAGE.read_text()
    begin, end = f"<!-- settings:{cls.__name__} -->\n", f"\n<!-- /settings:{cls.__name__} -->"
    assert begin in page, f"no settings table for {cls.__name__} in docs/settings.md"
    table = page.split(begin, 1)[1].split(end, 1)[0]
    assert table == settings.markdown_table(cls), (
        "docs/settings.md's settings table is out of date: regenerate it with "
        "`python -m shared.settings --update docs/settings.md`"
    )


def test_the_pools_example_is_the_file_in_examples() -> None:
    """The documentation's worked config is the one the pools tests run (as printed)."""
    section = MODELS_PAGE.read_text().split("# Many models behind one URL", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert config.parse(block) == config.load(ROOT / "examples" / "two-pools.yaml")


def test_the_readme_stays_a_front_page() -> None:
    """The manual lives in docs/; the README is what a newcomer reads on a screen or two."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail into docs/"
