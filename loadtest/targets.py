"""The servers ``make bench`` compares, and how each is started on this machine.

Every target serves the embedded SmolLM2-135M-Instruct from the same
converted directory, in float32, with the same engine flags. Cores are split
as ``llmgate serve`` splits them (``serve.plan.cpu_slices``): one engine
alone binds its compute threads to every core; two engines each get their
own slice; none holds a core back for a front end (but ``vllm-direct-default``).

* ``llmgate-1`` / ``llmgate-2``: ``llmgate serve`` with one / two workers.
* ``llmgate-1-preload``: ``llmgate-1`` with ``--cpu-preload true`` (tcmalloc
  and Intel's OpenMP runtime, where installed), to measure what the preload buys.
* ``vllm-direct``: ``python -m vllm.entrypoints.openai.api_server``, with
  llmgate's thread settings (no core reserved for the front end).
* ``vllm-direct-default``: the same at vLLM's own default (one core reserved).
* ``vllm-router-2``: two such servers, pinned like ``llmgate-2``'s workers,
  behind ``vllm-router`` (Rust), which lives in its own virtualenv
  (``.venv-router``, made on first use) so its dependencies cannot touch ours.
* ``fastapi-batching``: the seeds' baseline, ``loadtest.baselines.fastapi_batching``.
* ``vllm-inprocess``: vLLM's ``AsyncLLM`` driven in-process (``loadtest.inprocess``);
  not a server, so it is run by the bench, not here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtest.procs import await_ready, healthy_workers, launched
from loadtest.report import ROOT
from serve.plan import cpu_slices
from shared.embedded import SERVED_MODEL_NAME, default_model_dir
from shared.ports import free_port, free_port_range

MODEL = SERVED_MODEL_NAME
TARGETS = (
    "llmgate-1",
    "llmgate-1-preload",
    "llmgate-2",
    "vllm-direct",
    "vllm-direct-default",
    "vllm-router-2",
    "fastapi-batching",
    "vllm-inprocess",
)
ROUTER_VENV = ROOT / ".venv-router"
ROUTER_PACKAGE = "vllm-router==0.1.17"
# Shared with other tools that create the same virtualenv, so two never race.
ROUTER_LOCK = Path("/tmp/router-venv.lock")
# Load-aware like llmgate's default least-load policy: with two workers,
# power-of-two compares both. (Its default, cache_aware, sends one repeated
# prompt to one worker until the imbalance passes its thresholds.)
ROUTER_POLICY = "power_of_two"
KV_CACHE_GIB = "1"  # what an llmgate worker gets by default


@dataclass(frozen=True)
class Engine:
    """The engine settings every target shares, and the devices they run on."""

    enforce_eager: bool
    startup_timeout: float
    # A model directory on this host's disk; None: the embedded model.
    model_dir: str | None = None
    dtype: str = "float32"
    # GPUs visible here (0: CPU). Target "-1" gets GPU 0, "-2" GPUs 0 and 1.
    gpus: int = 0
    # vLLM's --block-size (KV-cache block, in tokens); 0: each engine's own default.
    block_size: int = 0

    @property
    def flags(self) -> list[str]:
        flags = ["--enforce-eager"] if self.enforce_eager else []
        if self.block_size:
            flags += ["--block-size", str(self.block_size)]
        return flags

    @property
    def model_path(self) -> str:
        return self.model_dir or str(default_model_dir())

    def gpu_env(self, devices: int | list[int]) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES`` for the first ``devices`` GPUs (or the listed ones)."""
        if not self.gpus:
            return {}
        chosen = list(range(devices)) if isinstance(devices, int) else devices
        if max(chosen) >= self.gpus:
            raise RuntimeError(f"this target needs {max(chosen) + 1} GPUs; {self.gpus} visible")
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, chosen))}


def parse_targets(text: str) -> list[str]:
    """``--targets`` (comma-separated, or ``all``) in the bench's fixed order."""
    wanted = {t.strip() for t in text.split(",") if t.strip()}
    if "all" in wanted:
        return list(TARGETS)
    unknown = sorted(wanted - set(TARGETS))
    if unknown:
        raise ValueError(f"unknown targets {unknown}; choose from {', '.join(TARGETS)} or all")
    if not wanted:
        raise ValueError("no targets given")
    return [t for t in TARGETS if t in wanted]


def engine_env(cpu_slice: str | None = None, vllm_default: bool = False) -> dict[str, str]:
    """The environment of a vLLM engine: small KV cache; pinned when given a
    core slice; no core held back for the front end, as ``llmgate serve``
    gives its workers (``serve.plan``), unless ``vllm_default``: then
    what vLLM does by itself (one core reserved), as ``vllm serve`` would run."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    if cpu_slice is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_slice
    if not vllm_default:
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def core_slices(count: int) -> list[str]:
    return cpu_slices(count, sorted(os.sched_getaffinity(0)))


def vllm_server_argv(port: int, engine: Engine) -> list[str]:
    flags = (
        f"--model {engine.model_path} --served-model-name {MODEL} --dtype {engine.dtype}"
        f" --host 127.0.0.1 --port {port}"
    )
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *flags.split(),
        *engine.flags,
    ]


def llmgate_argv(
    port: int, worker_base_port: int, workers: int, engine: Engine, preload: bool = False
) -> list[str]:
    # The embedded model, float32 and a 1 GiB KV cache are llmgate's defaults;
    # on GPUs it starts one worker per visible GPU (``gpu_env``).
    flags = f"--port {port} --worker-base-port {worker_base_port} --num-workers {workers}"
    model = ["--dtype", engine.dtype]
    if engine.model_dir:
        model += ["--model", engine.model_dir, "--served-model-name", MODEL]
    if preload:
        flags += " --cpu-preload true"
    return [sys.executable, "-m", "serve", *flags.split(), *model, *engine.flags]


def router_argv(port: int, worker_urls: list[str]) -> list[str]:
    return [
        str(ROUTER_VENV / "bin" / "vllm-router"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--worker-urls", *worker_urls),
        *("--policy", ROUTER_POLICY),
        *("--log-level", "warning"),
    ]


def ensure_router() -> Path:
    """``.venv-router`` with ``vllm-router`` installed; created on first use."""
    binary = ROUTER_VENV / "bin" / "vllm-router"
    with ROUTER_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            print(f"installing {ROUTER_PACKAGE} into {ROUTER_VENV.name}", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(ROUTER_VENV)], check=True)
            pip = [str(ROUTER_VENV / "bin" / "pip"), "install", "-q", ROUTER_PACKAGE]
            subprocess.run(pip, check=True)
    return binary


@contextlib.contextmanager
def serving(target: str, engine: Engine, run_dir: Path) -> Iterator[str]:
    """Start ``target``; yield its base URL once it can serve; stop all of it afterwards."""
    with contextlib.ExitStack() as stack:
        if target in ("llmgate-1", "llmgate-2", "llmgate-1-preload"):
            workers = 2 if target == "llmgate-2" else 1
            port, log = free_port(), run_dir / f"{target}.log"
            preload = target == "llmgate-1-preload"
            argv = llmgate_argv(port, free_port_range(workers), workers, engine, preload)
            env = {**os.environ, **engine.gpu_env(workers)}
            proc = stack.enter_context(launched(target, argv, log, env, ROOT))
            url = f"http://127.0.0.1:{port}"
            check = healthy_workers(workers)
            await_ready(target, proc, log, url + "/ready", engine.startup_timeout, check)
        elif target in ("vllm-direct", "vllm-direct-default"):
            port, log = free_port(), run_dir / f"{target}.log"
            argv = vllm_server_argv(port, engine)
            env = {**engine_env(vllm_default=target == "vllm-direct-default"), **engine.gpu_env(1)}
            proc = stack.enter_context(launched(target, argv, log, env, ROOT))
            url = f"http://127.0.0.1:{port}"
            await_ready(target, proc, log, url + "/v1/models", engine.startup_timeout)
        elif target == "vllm-router-2":
            ensure_router()
            servers = []
            for i, cpu_slice in enumerate(core_slices(2)):
                name, port = f"{target}/vllm-{i}", free_port()
                log = run_dir / f"{target}-vllm-{i}.log"
                argv = vllm_server_argv(port, engine)
                # One server per GPU on a GPU host, else per core slice.
                env = {**engine_env(cpu_slice), **engine.gpu_env([i])}
                proc = stack.enter_context(launched(name, argv, log, env, ROOT))
                servers.append((name, proc, log, f"http://127.0.0.1:{port}"))
            for name, proc, log, server_url in servers:
                await_ready(name, proc, log, server_url + "/v1/models", engine.startup_timeout)
            port, log = free_port(), run_dir / f"{target}-router.log"
            argv = router_argv(port, [s[3] for s in servers])
            proc = stack.enter_context(launched(target, argv, log, cwd=ROOT))
            url = f"http://127.0.0.1:{port}"
            await_ready(target, proc, log, url + "/v1/models", 60.0)
        elif target == "fastapi-batching":
            port, log = free_port(), run_dir / f"{target}.log"
            argv = [
                *(sys.executable, "-m", "loadtest.baselines.fastapi_batching"),
                *("--model-dir", engine.model_path, "--port", str(port)),
                *("--dtype", "auto" if engine.gpus else engine.dtype),
            ]
            env = {**os.environ, **engine.gpu_env(1)}
            proc = stack.enter_context(launched(target, argv, log, env, ROOT))
            url = f"http://127.0.0.1:{port}"
            await_ready(target, proc, log, url + "/health", engine.startup_timeout)
        else:
            raise ValueError(f"{target} is not a server")
        yield url
        print(f"[{target}] stopping", flush=True)
