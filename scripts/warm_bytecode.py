"""Write the bytecode of what llmgate's processes import, once, at install.

The install compiles none up front (``pip install --no-compile``): of the
~24,000 modules it installs, a whole ``make test`` imports about 6,200. This
imports what ``llmgate serve``'s processes do (the gateway, the worker's
front end, vLLM's engine core and model runner), so Python writes their
bytecode now, where on a machine that sets PYTHONDONTWRITEBYTECODE no process
would write it later and each would compile vLLM anew at every start. Run
with that variable unset (scripts/install.sh). A module that fails to import
here is skipped: it costs only a compile when it is imported.

    python scripts/warm_bytecode.py cpu|gpu
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys

OURS = ("gateway", "worker", "shared", "serve")
# vLLM's modules that the worker's processes import beyond what importing
# ours does: the worker builds vLLM's server inside functions, and the engine
# core and model runner import their parts as they start.
VLLM = (
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.entrypoints.launchers.app",
    "vllm.entrypoints.launchers.api_server.app_state",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.core.sched.scheduler",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama",
    "vllm.renderers.hf",
)
MODEL_RUNNER = {
    "cpu": ("vllm.v1.worker.cpu_worker", "vllm.v1.attention.backends.cpu_attn"),
    "gpu": ("vllm.v1.worker.gpu_worker",),
}


def modules(extras: str) -> list[str]:
    names: list[str] = []
    for package in OURS:
        names.append(package)
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            found = pkgutil.walk_packages(spec.submodule_search_locations, f"{package}.")
            # Not a package's __main__: importing it would run the command.
            names += [info.name for info in found if not info.name.endswith(".__main__")]
    device = "cpu" if "cpu" in extras else "gpu"
    return [*names, *VLLM, *MODEL_RUNNER[device]]


def main(argv: list[str]) -> None:
    for name in modules(argv[1] if len(argv) > 1 else "cpu"):
        try:
            importlib.import_module(name)
        except Exception:  # a warm-up: see the docstring
            continue


if __name__ == "__main__":
    main(sys.argv)
