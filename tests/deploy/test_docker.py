"""deploy/docker: the Dockerfiles, read as a docker engine would, and the health check.

No docker engine runs here, so the images are not built in tests; what a
build depends on is checked instead: multi-stage files, a non-root user, a
HEALTHCHECK and tini in every final stage, sources that exist and that
.dockerignore lets through, LLMGATE_* variables the code knows, a gateway
image without vLLM or torch. The health-check script runs for real against
an HTTP server.
"""

from __future__ import annotations

import fnmatch
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dockerfile
import msgspec
import pytest

from shared.settings import GatewaySettings, WorkerSettings
from tests.conftest import free_port
from tests.deploy.helpers import DEPLOY, ROOT, env_names, load_module

DOCKER = DEPLOY / "docker"
IMAGES: dict[str, tuple[str, type[msgspec.Struct]]] = {
    "gateway.Dockerfile": ("gateway", GatewaySettings),
    "worker-cpu.Dockerfile": ("worker", WorkerSettings),
    "worker-gpu.Dockerfile": ("worker", WorkerSettings),
}
healthcheck = load_module(DOCKER / "healthcheck.py")


def instructions(path: Path) -> list[dockerfile.Command]:
    """The file as BuildKit's own parser reads it (the `dockerfile` package wraps it)."""
    return list(dockerfile.parse_file(str(path)))


def final_stage(steps: list[dockerfile.Command]) -> list[dockerfile.Command]:
    last_from = max(i for i, step in enumerate(steps) if step.cmd == "FROM")
    return steps[last_from:]


def only(steps: list[dockerfile.Command], cmd: str) -> list[dockerfile.Command]:
    return [step for step in steps if step.cmd == cmd]


def env_of(steps: list[dockerfile.Command]) -> dict[str, str]:
    env: dict[str, str] = {}
    for step in only(steps, "ENV"):
        pairs = step.value
        env.update(zip(pairs[::2], pairs[1::2], strict=True))
    return env


INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK",
    "LABEL", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


@pytest.mark.parametrize("name", list(IMAGES))
def test_every_step_is_an_instruction_with_arguments(name: str) -> None:
    """The parser builds a tree of anything; a lost `\\` would show up here as `&&`."""
    steps = instructions(DOCKER / name)
    assert steps[0].cmd in ("ARG", "FROM")
    for step in steps:
        assert step.cmd in INSTRUCTIONS, f"line {step.start_line}: {step.original}"
        assert step.value or step.cmd == "CMD", f"line {step.start_line}: {step.original}"
    stages = {v[2] for v in (s.value for s in only(steps, "FROM")) if len(v) == 3}
    for step in only(steps, "COPY"):
        for flag in step.flags:
            if flag.startswith("--from="):
                assert flag.removeprefix("--from=") in stages, step.original


@pytest.mark.parametrize("name", list(IMAGES))
def test_final_stage_runs_as_non_root_with_a_health_check(name: str) -> None:
    steps = instructions(DOCKER / name)
    assert len(only(steps, "FROM")) >= 2, "multi-stage"
    final = final_stage(steps)
    users = only(final, "USER")
    assert users and users[-1].value[0].split(":")[0] not in ("0", "root")
    kind = IMAGES[name][0]
    (check,) = only(final, "HEALTHCHECK")
    assert check.value[0] == "CMD" and check.value[-2:] == ("/opt/llmgate/healthcheck.py", kind)
    (entrypoint,) = only(final, "ENTRYPOINT")
    assert entrypoint.json and entrypoint.value == ("tini", "--", "llmgate", kind)


@pytest.mark.parametrize("name", list(IMAGES))
def test_settings_and_ports_are_the_codes(name: str) -> None:
    kind, cls = IMAGES[name]
    final = final_stage(instructions(DOCKER / name))
    env = env_of(final)
    llmgate_vars = {k for k in env if k.startswith("LLMGATE_")} - {"LLMGATE_MODEL_CACHE"}
    assert llmgate_vars <= env_names(cls)
    exposed = {int(port) for step in only(final, "EXPOSE") for port in step.value}
    if kind == "gateway":
        assert env["LLMGATE_HOST"] == "0.0.0.0"
        assert exposed == {int(env["LLMGATE_PORT"])}
    else:
        assert env["LLMGATE_BIND"].startswith("tcp://0.0.0.0:")
        assert exposed == {
            int(env["LLMGATE_BIND"].rsplit(":", 1)[1]),
            int(env["LLMGATE_METRICS_PORT"]),
        }


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns)


def _local_copies(name: str) -> list[str]:
    """Sources of the COPY steps that read the build context (not another stage)."""
    sources = []
    for step in only(instructions(DOCKER / name), "COPY"):
        if not any(flag.startswith("--from=") for flag in step.flags):
            sources += step.value[:-1]
    return sources


@pytest.mark.parametrize("name", list(IMAGES))
def test_copied_sources_exist_and_are_in_the_build_context(name: str) -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = _local_copies(name)
    assert "deploy/docker/healthcheck.py" in sources
    for source in sources:
        assert (ROOT / source).exists(), f"{name}: COPY {source}"
        assert not _ignored(source, patterns), f"{name}: {source} is in .dockerignore"


_IMPORTED = """
import json, sys
import gateway.app, gateway.main
gateway.app.create_app_from_environment  # the factory uvicorn imports in the image
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_the_gateway_image_installs_no_engine() -> None:
    runs = [step.value[0] for step in only(instructions(DOCKER / "gateway.Dockerfile"), "RUN")]
    # Only the tracing extra: no [cpu]/[gpu] one.
    assert any('pip install "/src[tracing]" ' in run for run in runs)
    assert "worker" not in _local_copies("gateway.Dockerfile")
    # And the gateway's code imports none of the engine's stack.
    result = subprocess.run(
        [sys.executable, "-c", _IMPORTED], cwd=ROOT, capture_output=True, text=True, check=True
    )
    imported = set(json.loads(result.stdout))
    assert not imported & {"vllm", "torch", "transformers", "tokenizers", "worker"}


def _copy_build_context(target: Path) -> None:
    """What gateway.Dockerfile COPYs into /src."""
    for step in only(instructions(DOCKER / "gateway.Dockerfile"), "COPY"):
        if step.flags or not step.value[-1].startswith("/src"):
            continue
        for source in step.value[:-1]:
            if (ROOT / source).is_dir():
                shutil.copytree(
                    ROOT / source, target / source, ignore=shutil.ignore_patterns("__pycache__")
                )
            else:
                shutil.copy(ROOT / source, target / source)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # a pip install at a small share of a core
def test_the_gateway_images_install_step_gives_a_working_gateway(tmp_path: Path) -> None:
    """gateway.Dockerfile's build, minus docker: its sources, `pip install` with no
    extra into a fresh virtualenv, then `llmgate gateway` as the image runs it."""
    src, venv = tmp_path / "src", tmp_path / "venv"
    src.mkdir()
    _copy_build_context(src)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(src)],
        check=True,
        timeout=480,
        capture_output=True,
    )
    probe = "import importlib.util as u; print([m for m in ('vllm', 'torch') if u.find_spec(m)])"
    listed = subprocess.run(
        [str(python), "-c", probe], check=True, capture_output=True, text=True, timeout=60
    )
    assert listed.stdout.strip() == "[]"

    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", ""),
        "LLMGATE_HOST": "0.0.0.0",
        "LLMGATE_PORT": str(port),
        "LLMGATE_PROCESSES": "2",
        "LLMGATE_WORKERS": "tcp://llmgate-workers.invalid:5550",
    }
    gateway = subprocess.Popen(
        [str(venv / "bin" / "llmgate"), "gateway"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        check = [str(python), str(DOCKER / "healthcheck.py"), "gateway"]
        # A hang guard: two fresh processes importing the gateway may take
        # minutes at a small share of a core.
        deadline = time.monotonic() + 600
        while subprocess.run(check, env=env, capture_output=True).returncode != 0:
            assert gateway.poll() is None, "the gateway exited"
            assert time.monotonic() < deadline, "no /health within 600 s"
            time.sleep(0.5)
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=60) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()


class _Handler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path in ("/health", "/metrics") else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[http.server.HTTPServer]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    _Handler.status = 200


def run_check(kind: str, env: dict[str, str]) -> int:
    result = subprocess.run(
        [sys.executable, str(DOCKER / "healthcheck.py"), kind],
        env=env,
        capture_output=True,
        timeout=30,
    )
    return result.returncode


def test_health_check_passes_on_2xx_and_fails_otherwise(server: http.server.HTTPServer) -> None:
    port = str(server.server_address[1])
    assert run_check("gateway", {"LLMGATE_PORT": port}) == 0
    assert run_check("worker", {"LLMGATE_METRICS_PORT": port}) == 0
    _Handler.status = 503
    assert run_check("gateway", {"LLMGATE_PORT": port}) == 1
    server.shutdown()
    server.server_close()
    assert run_check("gateway", {"LLMGATE_PORT": port}) == 1  # nothing listening


def test_worker_check_without_a_metrics_port_passes() -> None:
    assert healthcheck.url_for("worker", {"LLMGATE_METRICS_PORT": "0"}) is None
    assert run_check("worker", {}) == 0
    assert run_check("nonsense", {}) == 2
