"""Writing a run's figures, as every bench tool leaves them: where (a directory
named for the tool and the UTC time under ``loadtest/results/``), the files
(``results.json`` with everything, CSV rows of measured dataclasses), and the
tables printed to the terminal (fixed-width text, or Markdown that
docs/benchmarks.md takes as printed)."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_ROOT = ROOT / "loadtest" / "results"


def stamp(when: datetime) -> str:
    """A run's UTC time as its results directory names it: ``20260101T120000Z``."""
    return f"{when:%Y%m%dT%H%M%SZ}"


def results_dir(tool: str, started: datetime, chosen: Path | None = None) -> Path:
    """``chosen`` (a ``--results-dir``), else ``loadtest/results/<stamp>-<tool>/``; created."""
    path = chosen or RESULTS_ROOT / f"{stamp(started)}-{tool}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, document: Any) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_csv(path: Path, rows: Sequence[Any], columns: Sequence[str] | None = None) -> None:
    """``rows`` (dataclasses), one a line: ``columns`` of them, else every field."""
    fieldnames = list(columns) if columns is not None else list(asdict(rows[0]))
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=fieldnames, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def write_json_and_csv(out_dir: Path, document: dict[str, Any], rows: Sequence[Any]) -> None:
    """``document`` as ``results.json``; ``rows`` (dataclasses) as ``results.csv``."""
    write_json(out_dir / "results.json", document)
    if rows:
        write_csv(out_dir / "results.csv", rows)


# (attribute, title, format, width): one column of a fixed-width text table.
TextColumn = tuple[str, str, str, int]


def text_table(columns: Sequence[TextColumn], rows: Iterable[Any]) -> str:
    """A header and a line per row: the first column left-aligned, the others
    right-aligned; a missing figure (None) shows as ``-``."""
    header = " ".join(
        f"{title:<{width}}" if i == 0 else f"{title:>{width}}"
        for i, (_, title, _, width) in enumerate(columns)
    )
    lines = [header]
    for row in rows:
        cells = []
        for key, _, fmt, width in columns:
            value = getattr(row, key)
            cells.append("-".rjust(width) if value is None else fmt.format(value))
        lines.append(" ".join(cells))
    return "\n".join(lines)


def ms(value: float | None) -> str:
    """Milliseconds in a table cell: thousands separated, "-" for none."""
    return "-" if value is None else f"{value:,.0f}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table of ``header`` and ``rows`` (cells already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
