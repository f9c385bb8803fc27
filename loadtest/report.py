"""Writing a run's figures: ``results.json`` (everything) and ``results.csv``
(one row per measured dataclass), as every bench tool leaves them."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any


def write_json_and_csv(out_dir: Path, document: dict[str, Any], rows: Sequence[Any]) -> None:
    """``document`` as ``results.json``; ``rows`` (dataclasses) as ``results.csv``."""
    (out_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    if not rows:
        return
    with (out_dir / "results.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
