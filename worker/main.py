"""``llmgate worker``: one worker process (one GPU, or a set of CPU cores).

Takes our worker settings plus every vLLM engine flag. Without ``--model``
it serves the embedded SmolLM2-135M-Instruct (converted on first use) in
float32 under the name ``smollm2-135m-instruct``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import MutableMapping

from shared import settings
from shared.logs import setup_logging
from worker import rpc_dir

log = logging.getLogger(__name__)

# vLLM's CPU backend otherwise sizes its KV cache from the node's memory and
# takes most of it, so a second engine on the same machine cannot start.
# GiB; ignored on GPUs.
DEFAULT_CPU_KVCACHE_GIB = "1"

# vLLM's CPU backend keeps the KV cache in blocks of 128 tokens unless told
# otherwise, and prefix caching reuses whole blocks only: each turn of a chat
# recomputes up to 127 tokens of its history (GPUs use 16-token blocks). 32
# is the smallest block its kernels prefer; on this project's machine it was
# no slower on the seed scenario and made multi-turn TTFT 1.5x shorter under
# the prefix policy (docs/benchmarks.md, 2026-11-26).
CPU_BLOCK_SIZE = 32


def build_parser() -> argparse.ArgumentParser:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from worker.engine import add_engine_args

    parser = FlexibleArgumentParser(  # type: ignore[no-untyped-call]
        prog="llmgate worker",
        description="Run one vLLM worker behind a ZeroMQ ROUTER socket.",
    )
    settings.add_arguments(parser, settings.WorkerSettings)
    add_engine_args(parser)
    # None means "the embedded model": vLLM's own default would download one.
    # The priority policy (vLLM's default is fcfs): the engine runs interactive
    # requests before a batch job's lines (protocol.Generate.priority).
    # Tool-call arguments held to the function's schema (vLLM's `parameter`
    # level) for every tool, not only those marked `strict`: under vLLM's
    # default (`auto`) a required or named call's arguments may be any JSON
    # (the embedded model answers the string "Paris" for {"city": ...}).
    parser.set_defaults(model=None, scheduling_policy="priority", tool_strict_level="parameter")
    return parser


def log_level(namespace: argparse.Namespace) -> str:
    """vLLM's ``--log-level``, or info: vLLM's parser leaves the flag out of
    the namespace when it is not given (``argparse.SUPPRESS``)."""
    return getattr(namespace, "log_level", None) or "info"


def apply_embedded_model_defaults(namespace: argparse.Namespace) -> None:
    """Point vLLM at the embedded model when no ``--model`` was given."""
    if namespace.model is not None:
        return
    from shared.embedded import SERVED_MODEL_NAME
    from worker.embedded_model import ensure_model

    namespace.model = str(ensure_model())
    if not namespace.served_model_name:
        namespace.served_model_name = [SERVED_MODEL_NAME]
    # bfloat16 flips this small model's greedy answers on near-ties on CPU;
    # float32 keeps them right. `--dtype bfloat16` trades that for speed.
    if namespace.dtype == "auto":
        namespace.dtype = "float32"


def apply_cpu_defaults(namespace: argparse.Namespace) -> None:
    """On a CPU engine, KV-cache blocks of ``CPU_BLOCK_SIZE`` tokens unless
    ``--block-size`` says otherwise."""
    if namespace.block_size is not None:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    namespace.block_size = CPU_BLOCK_SIZE
    log.info(
        "CPU engine: KV-cache blocks of %d tokens, the grain at which prefix caching "
        "reuses a conversation's history (vLLM's CPU default: 128; --block-size sets another)",
        CPU_BLOCK_SIZE,
    )


def apply_busy_wait(engine: settings.EngineSettings, environ: MutableMapping[str, str]) -> None:
    """On a CPU engine, vLLM's processes spin for at most ``--engine-busy-wait``
    seconds before they sleep (worker.engine_plugin reads the variable in each
    of them); on a GPU, vLLM's own window."""
    from vllm.platforms import current_platform

    from worker import engine_plugin

    busy_wait = engine.engine_busy_wait
    if not busy_wait >= 0:  # NaN too
        settings.refuse("llmgate worker: --engine-busy-wait must be at least 0")
    if not current_platform.is_cpu():
        environ.pop(engine_plugin.ENV, None)
        return
    environ[engine_plugin.ENV] = str(busy_wait)
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and engine_plugin.NAME not in allowed.split(","):
        log.warning(
            "VLLM_PLUGINS=%r leaves out %s: vLLM's processes keep their own busy wait",
            allowed,
            engine_plugin.NAME,
        )
    log.info(
        "CPU engine: vLLM's processes spin at most %g s for the next step, then sleep "
        "(vLLM's own window: 1 s; --engine-busy-wait)",
        busy_wait,
    )


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
    # Before vLLM reads its settings: its IPC sockets in a directory of our
    # own (worker.rpc_dir); the launcher gives its workers one already.
    own_rpc_dir = rpc_dir.make(os.environ, "worker")
    try:
        _main(argv)
    finally:
        rpc_dir.remove(own_rpc_dir)


def _main(argv: list[str] | None) -> None:
    parser = build_parser()
    namespace = parser.parse_args(argv)
    worker_settings = settings.from_namespace(settings.WorkerSettings, namespace)
    try:
        setup_logging(log_level(namespace), worker_settings.log_format)
    except ValueError as exc:
        settings.refuse(f"llmgate worker: {exc}")
    _check_keys(worker_settings)
    apply_embedded_model_defaults(namespace)
    apply_cpu_defaults(namespace)
    apply_busy_wait(worker_settings.engine, os.environ)
    if namespace.lora_modules:
        namespace.enable_lora = True  # as `vllm serve` needs it for --lora-modules
    _check_serve_args(namespace)

    from worker.engine import Engine
    from worker.prepare import Limits
    from worker.server import WorkerServer

    engine_settings = worker_settings.engine
    limits = Limits(engine_settings.max_input_tokens, engine_settings.max_total_tokens)

    async def run() -> None:
        engine = Engine(namespace, limits)
        try:
            await engine.start()
            await WorkerServer(worker_settings, engine).serve()
        finally:
            engine.shutdown()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    log.info("worker stopped")
    sys.exit(0)


def _check_serve_args(namespace: argparse.Namespace) -> None:
    """``vllm serve``'s own checks of its flags (a tool parser for auto tool
    choice, a valid chat template, ...), now rather than after the engine's start."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    from worker.vllm_app import serve_namespace

    try:
        validate_parsed_serve_args(serve_namespace(namespace))
    except (TypeError, ValueError) as exc:
        settings.refuse(f"llmgate worker: {exc}")


def _check_keys(worker_settings: settings.WorkerSettings) -> None:
    """Refuse a bad CURVE setting now, not after the engine's start."""
    from shared.curve_keys import KeyFileError, worker_curve

    try:
        worker_curve(worker_settings.link)
    except KeyFileError as exc:
        settings.refuse(f"llmgate worker: {exc}")


if __name__ == "__main__":
    main()
