"""Where the embedded default model's converted directory lives (no conversion
here: that is ``worker.embedded_model``), so the gateway can find its
tokenizer without importing the worker."""

from __future__ import annotations

import os
from pathlib import Path

SERVED_MODEL_NAME = "smollm2-135m-instruct"


def default_model_dir() -> Path:
    """Where the converted model lives: ``$LLMGATE_MODEL_CACHE`` or ``<project>/.models``."""
    root = os.environ.get("LLMGATE_MODEL_CACHE")
    base = Path(root) if root else Path(__file__).resolve().parent.parent / ".models"
    return base / SERVED_MODEL_NAME
