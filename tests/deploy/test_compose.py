"""deploy/compose: the compose file parses as the Compose spec and has one worker per GPU.

There is no docker engine here, so ``docker compose config`` is replaced by
what it does: YAML with anchors and merge keys, ``${VAR:-default}``
interpolation, then the Compose specification, checked by ``compose-spec``
(the Rust ``compose_spec`` crate's strict parser, plus its pydantic models of
the spec's JSON schema). On top of that, what makes this file work: one
worker per GPU device id, every worker reachable through the one name the
gateway resolves, settings that the code knows, files that exist, a state
store (PostgreSQL) that the gateway waits for.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from compose_spec import PyCompose

from gateway import metrics as gateway_metrics
from shared import config
from shared.settings import GatewaySettings, WorkerSettings
from tests.deploy.helpers import DEPLOY, ROOT, env_names, load_module

COMPOSE_DIR = DEPLOY / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
generate = load_module(COMPOSE_DIR / "generate.py")

_VARIABLE = re.compile(
    r"\$\$|\$\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}"
    r"|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``$$``."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("bare")
        op, default = match.group("op"), match.group("default") or ""
        if op == ":-" and not env.get(name):
            return default
        if op == "-" and name not in env:
            return default
        return env.get(name, "")

    return _VARIABLE.sub(substitute, value)


def load(text: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose model as ``docker compose config`` would see it; raises if invalid."""
    model = interpolate(yaml.safe_load(text), env or {})
    compose = PyCompose.from_json(json.dumps(model))
    compose.validate()
    compose.to_spec()
    assert isinstance(model, dict)
    return model


def workers(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in model["services"].items() if name.startswith("worker-")}


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    return list(reservations.get("devices", []))


@pytest.fixture(scope="module")
def committed() -> dict[str, Any]:
    return load(COMPOSE_FILE.read_text())


def test_the_committed_file_is_the_generators_output() -> None:
    first_line = COMPOSE_FILE.read_text().splitlines()[0]
    gpus = int(re.search(r"--gpus (\d+)", first_line).group(1))  # type: ignore[union-attr]
    assert COMPOSE_FILE.read_text() == generate.render(gpus), (
        f"regenerate: python deploy/compose/generate.py --gpus {gpus} > {COMPOSE_FILE}"
    )


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_one_worker_per_gpu_each_with_its_own_device_id(gpus: int) -> None:
    model = load(generate.render(gpus))
    gpu_workers = {n: s for n, s in workers(model).items() if "gpu" in s.get("profiles", [])}
    assert sorted(gpu_workers) == sorted(f"worker-gpu{i}" for i in range(gpus))
    for index in range(gpus):
        (device,) = gpu_devices(gpu_workers[f"worker-gpu{index}"])
        assert device["driver"] == "nvidia"
        assert device["device_ids"] == [str(index)]
        assert device["capabilities"] == ["gpu"]
        assert "count" not in device  # count and device_ids are exclusive


def test_the_committed_file_validates_and_reserves_each_gpu_once(
    committed: dict[str, Any],
) -> None:
    ids = [
        d for s in workers(committed).values() for dev in gpu_devices(s) for d in dev["device_ids"]
    ]
    assert len(ids) == len(set(ids)) == 8


def test_invalid_compose_is_rejected() -> None:
    """The validator bites: an unknown key and a malformed port fail."""
    text = COMPOSE_FILE.read_text()
    with pytest.raises(ValueError):
        load(text.replace("    stop_grace_period: 40s\n", "    stop_grace_perod: 40s\n", 1))
    with pytest.raises(ValueError):
        load(text, {"GATEWAY_PORT": "eighty"})


def test_the_cpu_profile_reserves_no_gpu(committed: dict[str, Any]) -> None:
    """`--profile cpu` starts the services with no profile and the cpu ones: no GPU there."""
    started = {
        name: s
        for name, s in committed["services"].items()
        if not s.get("profiles") or "cpu" in s["profiles"]
    }
    assert {"gateway", "worker-cpu"} <= started.keys()
    assert not any(gpu_devices(s) for s in started.values())
    assert committed["services"]["gateway"].get("profiles") is None
    for name, profile in [
        ("prometheus", "monitoring"),
        ("grafana", "monitoring"),
        ("redis", "redis"),
    ]:
        assert committed["services"][name]["profiles"] == [profile]


def test_the_gateway_finds_every_worker_through_one_name(committed: dict[str, Any]) -> None:
    """Each worker carries the alias that the gateway's LLMGATE_WORKERS resolves."""
    gateway = committed["services"]["gateway"]
    target = urlsplit(gateway["environment"]["LLMGATE_WORKERS"])
    assert target.scheme == "tcp"
    (gateway_network,) = gateway["networks"]
    for name, service in workers(committed).items():
        aliases = service["networks"][gateway_network]["aliases"]
        assert target.hostname in aliases, name
        bind = urlsplit(service["environment"]["LLMGATE_BIND"])
        assert bind.hostname == "0.0.0.0", name
        assert bind.port == target.port, name


def test_llmgate_variables_are_settings_the_code_has(
    committed: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway_env = committed["services"]["gateway"]["environment"]
    assert {k for k in gateway_env if k.startswith("LLMGATE_")} <= env_names(GatewaySettings)
    for key, value in gateway_env.items():
        monkeypatch.setenv(key, str(value))
    from shared import settings

    settings.from_environment(GatewaySettings)  # every value parses
    for name, service in workers(committed).items():
        names = {k for k in service["environment"] if k.startswith("LLMGATE_")}
        assert names <= env_names(WorkerSettings), name


def test_stop_grace_periods_cover_the_drain(committed: dict[str, Any]) -> None:
    def seconds(text: str) -> int:
        assert text.endswith("s")
        return int(text[:-1])

    for name, service in committed["services"].items():
        drain = service.get("environment", {}).get("LLMGATE_DRAIN_TIMEOUT")
        if drain is not None:
            assert seconds(service["stop_grace_period"]) > float(drain), name


def test_files_volumes_and_builds_exist(committed: dict[str, Any]) -> None:
    named = set(committed.get("volumes", {}))
    for name, service in committed["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source}"
            else:
                assert source in named, f"{name}: volume {source}"
        if "build" in service:
            context = COMPOSE_DIR / service["build"]["context"]
            assert (context / service["build"]["dockerfile"]).is_file(), name
        for dependency in service.get("depends_on", []):
            assert dependency in committed["services"], name


def test_worker_args_reach_every_worker() -> None:
    model = load(COMPOSE_FILE.read_text(), {"WORKER_ARGS": "--model /models/x --enforce-eager"})
    for name, service in workers(model).items():
        assert service["command"] == "--model /models/x --enforce-eager", name


def test_prometheus_scrapes_the_gateway_and_every_worker(committed: dict[str, Any]) -> None:
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gateway_port = committed["services"]["gateway"]["environment"]["LLMGATE_PORT"]
    assert jobs["llmgate-gateway"]["static_configs"][0]["targets"] == [f"gateway:{gateway_port}"]
    (discovery,) = jobs["llmgate-workers"]["dns_sd_configs"]
    for name, service in workers(committed).items():
        (network,) = service["networks"]
        assert discovery["names"][0] in service["networks"][network]["aliases"], name
        assert str(discovery["port"]) == service["environment"]["LLMGATE_METRICS_PORT"], name


def _dashboard_metrics() -> set[str]:
    dashboard = json.loads((DEPLOY / "helm/llmgate/dashboards/llmgate.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    found = set()
    for expr in exprs:
        found |= set(re.findall(r"\b((?:llmgate_|vllm:)[a-z_:]+)", expr))
    return found


def test_the_dashboard_charts_metrics_that_exist() -> None:
    """Every llmgate_* series is the gateway's; every vllm:* one is in vLLM's source."""
    import importlib.util

    ours = set()
    for collector in vars(gateway_metrics).values():
        name = getattr(collector, "_name", None)
        if isinstance(name, str) and name.startswith("llmgate_"):
            ours.add(name)
    vllm_spec = importlib.util.find_spec("vllm")
    assert vllm_spec and vllm_spec.origin
    vllm_source = "".join(
        p.read_text() for p in (Path(vllm_spec.origin).parent / "v1/metrics").glob("*.py")
    )
    suffix = re.compile(r"_(total|bucket|sum|count)$")
    used = _dashboard_metrics()
    assert any(m.startswith("llmgate_") for m in used) and any(m.startswith("vllm:") for m in used)
    for metric in used:
        base = suffix.sub("", metric)
        if metric.startswith("llmgate_"):
            assert base in ours, metric
        else:
            assert f'"{base}"' in vllm_source, metric


DOCKER_COMPOSE = shutil.which("docker-compose")


@pytest.mark.skipif(
    DOCKER_COMPOSE is None, reason="no docker-compose (Debian: apt-get install docker-compose)"
)
def test_docker_compose_config_reads_it_the_same_way(tmp_path: Path) -> None:
    """Docker's own Compose (v1, Python; `config` needs no engine) agrees with `load`.

    v1 predates the top-level `name` (v2 reads it): that line is left out for it.
    """
    env = {"WORKER_ARGS": "--model /m --enforce-eager", "GATEWAY_PORT": "9000"}
    v1_file = tmp_path / "compose.yaml"
    v1_file.write_text(re.sub(r"(?m)^name: .*\n", "", COMPOSE_FILE.read_text()))
    result = subprocess.run(
        [
            DOCKER_COMPOSE or "",
            "-f",
            str(v1_file),
            "--project-directory",
            str(COMPOSE_DIR),
            "config",
        ],
        env={"PATH": os.environ.get("PATH", "")} | env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    theirs = yaml.safe_load(result.stdout)["services"]
    ours = load(COMPOSE_FILE.read_text(), env)["services"]
    assert theirs.keys() == ours.keys()
    for name, service in ours.items():
        assert theirs[name].get("profiles") == service.get("profiles"), name
        assert theirs[name].get("command") == service.get("command"), name
        assert {k: str(v) for k, v in theirs[name].get("environment", {}).items()} == {
            k: str(v) for k, v in service.get("environment", {}).items()
        }, name
        assert gpu_devices(theirs[name]) == gpu_devices(service), name
    assert theirs["gateway"]["ports"] == [{"published": 9000, "target": 8000}]


@pytest.mark.parametrize("cpu", [False, True])
def test_a_pools_config_gets_a_worker_service_per_pool_worker(cpu: bool) -> None:
    example = ROOT / "examples" / "two-pools.yaml"
    model = load(generate.render_pools(str(example), cpu=cpu))
    pool_workers = {n: s for n, s in workers(model).items() if "LLMGATE_POOL" in s["environment"]}
    assert sorted(pool_workers) == ["worker-large-0", "worker-small-0"]
    expected = {"small": ("smollm2-bf16", "0"), "large": ("smollm2-f32", "1")}
    for name, service in pool_workers.items():
        pool = service["environment"]["LLMGATE_POOL"]
        served, devices = expected[pool]
        command = service["command"]
        assert command[command.index("--served-model-name") + 1] == served, name
        assert "profiles" not in service  # `up` starts them
        if cpu:
            assert service["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == devices
            assert service["cpuset"] == devices and not gpu_devices(service)
        else:
            (device,) = gpu_devices(service)
            assert device["device_ids"] == [devices]
        names = {k for k in service["environment"] if k.startswith("LLMGATE_")}
        assert names <= env_names(WorkerSettings), name
    # The gateway reads the same file, inlined as a Compose config.
    gateway = model["services"]["gateway"]
    (mount,) = gateway["configs"]
    assert gateway["environment"]["LLMGATE_CONFIG"] == mount["target"]
    content = model["configs"][mount["source"]]["content"]
    assert config.parse(content) == config.load(example)
    assert {k for k in gateway["environment"] if k.startswith("LLMGATE_")} <= env_names(
        GatewaySettings
    )


def test_the_cache_settings_reach_the_gateway_and_default_to_the_codes(
    committed: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset, the cache variables are the settings' defaults (so a pools file's
    `cache:` still applies); GATEWAY_CACHE=redis://redis:6379/0 names the
    `redis` profile's service on the gateway's network."""
    from shared import settings

    defaults = GatewaySettings().caching
    env = committed["services"]["gateway"]["environment"]
    for key in ("LLMGATE_CACHE", "LLMGATE_CACHE_TTL", "LLMGATE_CACHE_SCOPE"):
        monkeypatch.setenv(key, str(env[key]))
    parsed = settings.from_environment(GatewaySettings).caching
    assert (parsed.cache, parsed.cache_ttl, parsed.cache_scope) == (
        defaults.cache,
        defaults.cache_ttl,
        defaults.cache_scope,
    )
    url = "redis://redis:6379/0"
    model = load(COMPOSE_FILE.read_text(), {"GATEWAY_CACHE": url, "GATEWAY_CACHE_TTL": "60"})
    gateway = model["services"]["gateway"]
    assert (
        gateway["environment"]["LLMGATE_CACHE"],
        gateway["environment"]["LLMGATE_CACHE_TTL"],
    ) == (
        url,
        "60",
    )
    redis = model["services"][urlsplit(url).hostname or ""]
    assert redis["profiles"] == ["redis"]
    assert set(redis["networks"]) & set(gateway["networks"])
    assert urlsplit(url).port == 6379  # redis-server's default port
    assert "--port" not in redis["command"]


@pytest.mark.parametrize("password", [None, "s3cret"])
def test_the_gateway_keeps_its_state_in_the_postgres_service_once_healthy(
    password: str | None,
) -> None:
    """LLMGATE_STATE_DB names the postgres service with the user, password and
    database it creates; the gateway starts once it is healthy and has no state
    volume of its own (SQLite is not used with a state DB)."""
    env = {"POSTGRES_PASSWORD": password} if password else {}
    for text in (
        COMPOSE_FILE.read_text(),
        generate.render_pools(str(ROOT / "examples" / "two-pools.yaml"), cpu=True),
    ):
        model = load(text, env)
        gateway = model["services"]["gateway"]
        url = urlsplit(gateway["environment"]["LLMGATE_STATE_DB"])
        assert "LLMGATE_STATE_DB" in env_names(GatewaySettings)
        assert url.scheme == "postgresql" and url.port == 5432
        postgres = model["services"][url.hostname or ""]
        assert postgres["image"] == "postgres:16-alpine"
        assert "profiles" not in postgres  # starts with the gateway, whatever the profiles
        assert set(postgres["networks"]) & set(gateway["networks"])
        created = postgres["environment"]
        assert (url.username, url.password, url.path) == (
            created["POSTGRES_USER"],
            created["POSTGRES_PASSWORD"],
            "/" + created["POSTGRES_DB"],
        )
        assert url.password == (password or "llmgate")
        assert gateway["depends_on"] == {url.hostname: {"condition": "service_healthy"}}
        check = postgres["healthcheck"]["test"]
        assert check[:2] == ["CMD", "pg_isready"]
        assert check[check.index("-U") + 1] == created["POSTGRES_USER"]
        assert check[check.index("-d") + 1] == created["POSTGRES_DB"]
        (data,) = postgres["volumes"]
        assert data == "postgres-data:/var/lib/postgresql/data"
        assert "postgres-data" in model["volumes"] and "gateway-state" not in model["volumes"]
        assert not [v for v in gateway["volumes"] if v.endswith(":/var/lib/llmgate")]


def test_prometheus_sends_a_key_to_the_gateway_from_the_keys_directory(
    committed: dict[str, Any],
) -> None:
    """With API keys, the gateway's /metrics takes an admin key: Prometheus sends
    the one in keys/metrics-token, mounted where the scrape config reads it."""
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    authorization = jobs["llmgate-gateway"]["authorization"]
    assert authorization["type"] == "Bearer"
    token = authorization["credentials_file"]
    mounts = committed["services"]["prometheus"]["volumes"]
    [folder] = [m.split(":")[1] for m in mounts if m.startswith("./keys:")]
    assert token == f"{folder}/metrics-token"
    assert "authorization" not in jobs["llmgate-workers"]  # vLLM's metrics port has no keys
