"""The documentation site builds with ``mkdocs build --strict``, as ``make docs`` builds it.

Strict, so a broken link, a missing anchor or a page left out of the nav in
``mkdocs.yml`` fails here, in ``make test``, and not only in ``make lint``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr}"
    assert (tmp_path / "index.html").is_file()


def test_every_page_is_in_the_nav() -> None:
    """A page missing from the nav is a strict-mode failure too; this names it without mkdocs."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f" {page.name}\n" in nav, f"docs/{page.name} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_no_issue_numbers_in_user_documentation(path: Path) -> None:
    text = path.read_text()
    found = re.findall(r"\bissues? \d+|(?<![\w&(/])#\d+\b", text, flags=re.IGNORECASE)
    assert not found, f"{path.name} cites issue numbers: {found}"


def test_the_code_map_is_generated_from_the_package_docstrings() -> None:
    spec = importlib.util.spec_from_file_location("code_map", ROOT / "scripts" / "code_map.py")
    assert spec is not None and spec.loader is not None
    code_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code_map)
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert code_map.BEGIN + code_map.table() + code_map.END in page, (
        "docs/architecture.md's code map is out of date: regenerate it with "
        "`python scripts/code_map.py --update docs/architecture.md`"
    )
