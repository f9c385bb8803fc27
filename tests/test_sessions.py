"""make test's sessions (scripts/test.sh): the integration modules it runs in
a session of their own, beside the integration session, start systems of
their own. One that took the session's system (``served``) would start a
second one in that session: an engine more than the machine holds at once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SESSION_FIXTURE = "served"  # tests/conftest.py: the integration session's system


def alone_modules() -> list[str]:
    """The modules scripts/test.sh runs beside the integration session."""
    script = (ROOT / "scripts" / "test.sh").read_text()
    found = re.search(r"^ALONE=\((.*?)^\)", script, re.DOTALL | re.MULTILINE)
    assert found, "no ALONE=( ... ) list in scripts/test.sh"
    return found.group(1).split()


def test_the_modules_run_beside_the_integration_session_take_no_session_system() -> None:
    modules = alone_modules()
    assert modules and all((ROOT / module).is_file() for module in modules), modules
    # pytest's own answer, fixtures of fixtures and autouse ones included;
    # --collect-only keeps conftest from starting any system.
    listing = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "no:cacheprovider"),
            *("--collect-only", "--fixtures-per-test", *modules),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert listing.returncode == 0, listing.stdout + listing.stderr
    per_test = re.split(r"^-+ fixtures used by ", listing.stdout, flags=re.MULTILINE)[1:]
    assert len(per_test) >= len(modules), listing.stdout
    taking = [
        block.split()[0]
        for block in per_test
        if re.search(rf"^{SESSION_FIXTURE} -- ", block, re.MULTILINE)
    ]
    assert taking == [], (
        f"these tests take the session's system; move their modules out of "
        f"scripts/test.sh's ALONE list: {taking}"
    )
