"""Logging setup shared by every process: one line per record, process name first."""

from __future__ import annotations

import logging


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(processName)s[%(process)d] %(name)s: %(message)s",
    )
