"""The code map in docs/architecture.md, generated from the packages' docstrings.

One row per package: its path, the first paragraph of its ``__init__``
docstring, and its modules. ``python scripts/code_map.py --update
docs/architecture.md`` rewrites the table between its markers;
tests/test_docs.py fails when it is out of date, so it cannot drift.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("gateway", "worker", "shared", "serve", "loadtest", "tests/harness")
BEGIN = "<!-- code-map -->\n"
END = "\n<!-- /code-map -->"


def _summary(package: Path) -> str:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def table() -> str:
    rows = ["| package | what it holds | modules |", "|---|---|---|"]
    for top in TOPS:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            package = init.parent
            if "__pycache__" in package.parts or package.name == "results":
                continue
            modules = sorted(
                p.name for p in package.iterdir() if p.suffix == ".py" and p.name != "__init__.py"
            )
            path = package.relative_to(ROOT).as_posix()
            listed = ", ".join(f"`{m}`" for m in modules)
            rows.append(f"| `{path}/` | {_summary(package).replace('|', '/')} | {listed} |")
    return "\n".join(rows)


def update(path: Path) -> None:
    text = path.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(text[:start] + table() + text[stop:])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--update"]:
        update(Path(sys.argv[2]))
    else:
        print(table())
