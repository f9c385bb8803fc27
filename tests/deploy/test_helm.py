"""deploy/helm/llmgate: the chart renders to valid Kubernetes objects that fit together.

Rendering is Helm's own (``helm-python-sdk`` binds Helm v4's Go SDK, so the
templates run through the real template engine, Sprig functions, the
values schema and ``helm lint``). Each rendered object is validated against
the Kubernetes OpenAPI schemas of the oldest and newest versions the chart
supports (``kubernetes-validate``, strict: unknown fields fail). Then the
wiring: the gateway's ``--workers`` names the headless Service, which selects
the worker pods on the port they bind; probes, drain times and settings names
agree with the code, and the gateways share one state store (a PostgreSQL
named by a Secret) or the chart refuses to run more than one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import helm_python as helm
import kubernetes_validate
import msgspec
import pytest
import yaml

from shared import api_keys, config
from shared.api_keys import sha256_hex
from shared.settings import GatewaySettings, LinkSettings, WorkerSettings
from tests.deploy.helpers import DEPLOY, env_names

CHART = DEPLOY / "helm" / "llmgate"
RELEASE, NAMESPACE = "demo", "llm"
K8S_VERSIONS = ["1.25.0", "1.37.0"]

SECRETS = {
    "apiKeys": ["sk-one", "sk-two"],
    "metricsToken": "sk-prometheus",
    "curve": {
        "gatewayKey": "gw-public",
        "gatewayKeySecret": "gw-secret",
        "workerKey": "wk-public",
        "workerKeySecret": "wk-secret",
    },
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "eight-gpus-everything-on": {
        "worker": {
            "replicas": 8,
            "args": ["--model", "meta-llama/Llama-3.1-8B-Instruct"],
            "modelCache": {"enabled": True, "size": "200Gi"},
            "settings": {"max_total_tokens": 8192},
        },
        "gateway": {
            "autoscaling": {"targetInFlightPerPod": 64},
            "settings": {"policy": "prefix", "max-queue": 2048},
            "cache": {"url": "redis://redis.llm:6379/0", "ttl": 600, "scope": "greedy"},
        },
        "secrets": SECRETS,
        "metrics": {"serviceMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True}},
    },
    "cpu-workers-fixed-gateways": {
        "worker": {"image": {"repository": "llmgate/worker-cpu"}, "gpu": {"enabled": False}},
        "gateway": {"autoscaling": {"enabled": False}, "replicas": 3},
    },
    "existing-secret": {"secrets": {"existingSecret": "my-keys"}},
    # The state store: the demo PostgreSQL is the default's; these are the others.
    "external-database-url": {
        "state": {"database": {"url": "postgresql://llmgate:pw@db.example:5432/llmgate"}},
        "postgresql": {"enabled": False},
    },
    "existing-database-secret": {
        "state": {"database": {"existingSecret": "my-db", "key": "dsn"}},
        "postgresql": {"enabled": False},
        "gateway": {"autoscaling": {"enabled": False}, "replicas": 4},
    },
    "one-gateway-no-store": {
        "postgresql": {"enabled": False},
        "gateway": {"autoscaling": {"enabled": False}, "replicas": 1},
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    values = VALUE_SETS[request.param]
    return values, render(values)


def one(objects: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    found = [o for o in of_kind(objects, kind, component)]
    assert len(found) == 1, f"{len(found)} {kind}/{component}"
    return found[0]


def of_kind(
    objects: list[dict[str, Any]], kind: str, component: str | None = None
) -> Iterator[dict[str, Any]]:
    for o in objects:
        labels = o["metadata"].get("labels", {})
        if o["kind"] == kind and component in (None, labels.get("app.kubernetes.io/component")):
            yield o


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    assert isinstance(c, dict)
    return c


def environment(objects: list[dict[str, Any]], workload: dict[str, Any]) -> dict[str, str]:
    """The container's variables: its ConfigMap (envFrom), then its own env values."""
    by_name = {o["metadata"]["name"]: o for o in of_kind(objects, "ConfigMap")}
    env: dict[str, str] = {}
    c = container(workload)
    for source in c.get("envFrom", []):
        env.update(by_name[source["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e.get("value", "<from field>") for e in c.get("env", [])})
    return env


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_every_object_is_valid_kubernetes(rendered: tuple[Any, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked in test_service_monitors_select_the_services
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_rejects_an_unknown_field() -> None:
    deployment = one(render({}), "Deployment", "gateway")
    container(deployment)["livenessProbes"] = container(deployment).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_the_gateway_finds_workers_through_the_headless_service(
    rendered: tuple[Any, list[dict[str, Any]]],
) -> None:
    _, objects = rendered
    gateway = one(objects, "Deployment", "gateway")
    workers = one(objects, "StatefulSet", "worker")
    address = urlsplit(environment(objects, gateway)["LLMGATE_WORKERS"])
    service_name, namespace, svc, *_ = (address.hostname or "").split(".")
    assert (namespace, svc) == (NAMESPACE, "svc")
    (headless,) = [s for s in of_kind(objects, "Service") if s["metadata"]["name"] == service_name]
    assert headless["spec"]["clusterIP"] == "None"
    assert workers["spec"]["serviceName"] == service_name
    pod_labels = workers["spec"]["template"]["metadata"]["labels"]
    assert selects(headless["spec"]["selector"], pod_labels)
    assert not selects(
        headless["spec"]["selector"], gateway["spec"]["template"]["metadata"]["labels"]
    )
    # The address's port is the service's, the container's and the one the worker binds.
    ports = {p["name"]: p for p in container(workers)["ports"]}
    (zmq_port,) = [p for p in headless["spec"]["ports"] if p["port"] == address.port]
    assert zmq_port["targetPort"] == "zmq" and ports["zmq"]["containerPort"] == address.port
    bind = urlsplit(environment(objects, workers)["LLMGATE_BIND"])
    assert (bind.hostname, bind.port) == ("0.0.0.0", address.port)


def test_each_worker_pod_gets_its_gpus(rendered: tuple[dict[str, Any], Any]) -> None:
    values, objects = rendered
    workers = one(objects, "StatefulSet", "worker")
    resources = container(workers)["resources"]
    worker_values = values.get("worker", {})
    assert workers["spec"]["replicas"] == worker_values.get("replicas", 2)
    if worker_values.get("gpu", {}).get("enabled", True):
        assert resources["limits"]["nvidia.com/gpu"] == 1
        assert resources["requests"]["nvidia.com/gpu"] == 1
    else:
        assert "nvidia.com/gpu" not in resources.get("limits", {})


def test_probes_and_grace_periods_match_the_drain(
    rendered: tuple[Any, list[dict[str, Any]]],
) -> None:
    _, objects = rendered
    gateway = one(objects, "Deployment", "gateway")
    c = container(gateway)
    env = environment(objects, gateway)
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": int(env["LLMGATE_PORT"])}
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    grace = gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + float(env["LLMGATE_DRAIN_TIMEOUT"]) + 5

    workers = one(objects, "StatefulSet", "worker")
    c = container(workers)
    env = environment(objects, workers)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == int(env["LLMGATE_METRICS_PORT"]) > 0
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    grace = workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(env["LLMGATE_DRAIN_TIMEOUT"])


def test_workers_roll_one_at_a_time_once_the_gateways_can_find_the_last(
    rendered: tuple[Any, list[dict[str, Any]]],
) -> None:
    """A rolling update's next pod waits until the gateways' DNS look-up and a
    heartbeat have found the restarted one: its drain needs somewhere to move to."""
    _, objects = rendered
    gateway_env = environment(objects, one(objects, "Deployment", "gateway"))
    resolve = float(gateway_env.get("LLMGATE_RESOLVE_INTERVAL", LinkSettings().resolve_interval))
    heartbeat = float(
        gateway_env.get("LLMGATE_HEARTBEAT_INTERVAL", LinkSettings().heartbeat_interval)
    )
    spec = one(objects, "StatefulSet", "worker")["spec"]
    assert spec["updateStrategy"] == {"type": "RollingUpdate"}
    assert spec["minReadySeconds"] > resolve + heartbeat


def test_settings_are_ones_the_code_has(rendered: tuple[Any, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    components: list[tuple[str, type[msgspec.Struct]]] = [
        ("gateway", GatewaySettings),
        ("worker", WorkerSettings),
    ]
    for component, cls in components:
        data = one(objects, "ConfigMap", component)["data"]
        unknown = set(data) - env_names(cls)
        assert not unknown, f"{component}: no such settings {sorted(unknown)}"


def test_secret_files_are_mounted_where_the_settings_point(
    rendered: tuple[Any, list[dict[str, Any]]],
) -> None:
    """Each *_FILE setting names a mounted Secret file, each *_DIR one a mounted directory."""
    _, objects = rendered
    secrets = {s["metadata"]["name"]: s for s in of_kind(objects, "Secret")}
    for kind, component in [("Deployment", "gateway"), ("StatefulSet", "worker")]:
        workload = one(objects, kind, component)
        env = environment(objects, workload)
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
        files: set[str] = set()
        dirs: set[str] = set()
        for mount in container(workload).get("volumeMounts", []):
            secret = volumes.get(mount["name"], {}).get("secret")
            if secret is None:
                continue
            if secret["secretName"] in secrets:  # created by the chart: the keys must exist
                assert {i["key"] for i in secret["items"]} <= set(
                    secrets[secret["secretName"]]["stringData"]
                )
            dirs.add(mount["mountPath"])
            files |= {f"{mount['mountPath']}/{i['path']}" for i in secret["items"]}
        for name, path in env.items():
            if name.endswith("_FILE"):
                assert path in files, f"{component}: {name}={path} is not mounted"
            if name.endswith("_DIR"):
                assert path in dirs, f"{component}: {name}={path} is not mounted"


def test_curve_keys_go_to_the_side_that_needs_them() -> None:
    """Workers get their key pair and the gateway's public key alone; gateways the reverse."""
    objects = render(VALUE_SETS["eight-gpus-everything-on"])
    gateway_env = environment(objects, one(objects, "Deployment", "gateway"))
    worker = one(objects, "StatefulSet", "worker")
    worker_env = environment(objects, worker)
    assert gateway_env["LLMGATE_CURVE_GATEWAY_KEY_FILE"].endswith("/gateway.key_secret")
    assert gateway_env["LLMGATE_CURVE_WORKER_PUBLIC_KEY_FILE"].endswith("/worker.key")
    assert worker_env["LLMGATE_CURVE_WORKER_KEY_FILE"].endswith("/worker.key_secret")
    keys_dir = worker_env["LLMGATE_CURVE_GATEWAY_KEYS_DIR"]
    mounts = {m["mountPath"]: m["name"] for m in container(worker)["volumeMounts"]}
    volumes = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}
    items = volumes[mounts[keys_dir]]["secret"]["items"]
    assert items == [{"key": "gateway.key", "path": "gateway.key"}]
    assert "LLMGATE_CURVE_WORKER_KEY_FILE" not in environment(
        render({}), one(render({}), "StatefulSet", "worker")
    )


def test_api_keys_reach_the_gateway_and_the_metrics_token_is_an_admin_key() -> None:
    objects = render(VALUE_SETS["eight-gpus-everything-on"])
    (secret,) = [
        s for s in of_kind(objects, "Secret") if s["metadata"]["name"] == "demo-llmgate-secrets"
    ]
    entries = api_keys.parse(secret["stringData"]["api-keys"], "api-keys")
    # Named as the gateway names a plain key: the same usage rows and metrics as before.
    assert [(e.name, e.key_sha256, e.admin) for e in entries] == [
        *((api_keys.plain_entry(k).name, sha256_hex(k), False) for k in SECRETS["apiKeys"]),
        ("prometheus", sha256_hex(str(SECRETS["metricsToken"])), True),
    ]
    assert secret["stringData"]["metrics-token"] == SECRETS["metricsToken"]
    assert "LLMGATE_API_KEYS_FILE" in environment(objects, one(objects, "Deployment", "gateway"))


def test_prometheus_sends_the_metrics_token_to_the_gateway_only() -> None:
    """With API keys, the gateway's /metrics takes an admin key (workers' take none)."""
    objects = render(VALUE_SETS["eight-gpus-everything-on"])
    [gateway] = of_kind(objects, "ServiceMonitor", "gateway")
    [endpoint] = gateway["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "demo-llmgate-secrets", "key": "metrics-token"},
    }
    [worker] = of_kind(objects, "ServiceMonitor", "worker")
    assert all("authorization" not in e for e in worker["spec"]["endpoints"])
    # No keys: nothing to send.
    [bare] = of_kind(
        render({"metrics": {"serviceMonitor": {"enabled": True}}}), "ServiceMonitor", "gateway"
    )
    assert "authorization" not in bare["spec"]["endpoints"][0]
    # A Secret you manage holds the token under the same name.
    managed = {
        "secrets": {"existingSecret": "my-keys"},
        "metrics": {"serviceMonitor": {"enabled": True}},
    }
    [mine] = of_kind(render(managed), "ServiceMonitor", "gateway")
    assert mine["spec"]["endpoints"][0]["authorization"]["credentials"] == {
        "name": "my-keys",
        "key": "metrics-token",
    }


def test_api_keys_and_a_service_monitor_without_a_metrics_token_do_not_render() -> None:
    values = {
        "secrets": {"apiKeys": ["sk-one"]},
        "metrics": {"serviceMonitor": {"enabled": True}},
    }
    with pytest.raises(Exception, match="metricsToken"):
        render(values)


def test_cache_values_become_the_gateways_cache_settings() -> None:
    """Set, gateway.cache is LLMGATE_CACHE* (as the code parses it); unset, nothing."""
    unset = render({})
    assert not {k for k in environment(unset, one(unset, "Deployment", "gateway")) if "CACHE" in k}
    cache = {"url": "redis://redis.llm:6379/0", "ttl": 1000000, "maxBytes": 1000000}
    objects = render({"gateway": {"cache": cache | {"scope": "all"}}})
    env = environment(objects, one(objects, "Deployment", "gateway"))
    assert {k: v for k, v in env.items() if "CACHE" in k} == {
        "LLMGATE_CACHE": "redis://redis.llm:6379/0",
        "LLMGATE_CACHE_TTL": "1000000",
        "LLMGATE_CACHE_MAX_BYTES": "1000000",
        "LLMGATE_CACHE_SCOPE": "all",
    }
    objects = render({"gateway": {"cache": {"url": "memory", "ttl": 2.5}}})
    env = environment(objects, one(objects, "Deployment", "gateway"))
    assert (env["LLMGATE_CACHE"], env["LLMGATE_CACHE_TTL"]) == ("memory", "2.5")
    assert "LLMGATE_CACHE_SCOPE" not in env


def test_autoscaler_and_disruption_budget_target_the_gateway() -> None:
    objects = render(VALUE_SETS["eight-gpus-everything-on"])
    gateway = one(objects, "Deployment", "gateway")
    hpa = one(objects, "HorizontalPodAutoscaler", "gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == gateway["metadata"]["name"]
    kinds = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert kinds["Resource"]["resource"]["name"] == "cpu"
    assert kinds["Pods"]["pods"]["metric"]["name"] == "llmgate_requests_in_flight"
    assert "replicas" not in gateway["spec"]  # the HPA owns it
    pdb = one(objects, "PodDisruptionBudget", "gateway")
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)

    fixed = render(VALUE_SETS["cpu-workers-fixed-gateways"])
    assert not list(of_kind(fixed, "HorizontalPodAutoscaler"))
    assert one(fixed, "Deployment", "gateway")["spec"]["replicas"] == 3


def test_service_monitors_select_the_services() -> None:
    objects = render(VALUE_SETS["eight-gpus-everything-on"])
    monitors = list(of_kind(objects, "ServiceMonitor"))
    assert {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in monitors} == {
        "gateway",
        "worker",
    }
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        matched = [
            s
            for s in of_kind(objects, "Service")
            if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        assert len(matched) == 1, monitor["metadata"]["name"]
        port_names = {p["name"] for p in matched[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "authorization"}
            assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"


def test_the_dashboard_configmap_is_the_dashboard_file() -> None:
    objects = render(VALUE_SETS["eight-gpus-everything-on"])
    (dashboard,) = [c for c in of_kind(objects, "ConfigMap") if "llmgate.json" in c["data"]]
    shipped = json.loads((CHART / "dashboards" / "llmgate.json").read_text())
    assert json.loads(dashboard["data"]["llmgate.json"]) == shipped


# Two pools (docs/models.md): GPU workers, and CPU ones
# that take their spill-over.
TWO_POOLS: dict[str, Any] = {
    "pools": [
        {
            "name": "small",
            "servedModelName": "llama-8b",
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "replicas": 4,
            "args": ["--max-model-len", "8192"],
            "spillAfter": 0,
        },
        {
            "name": "small-cpu",
            "servedModelName": "llama-8b-cpu",
            "tier": 2,
            "substituteFor": ["llama-8b"],
            "image": {"repository": "llmgate/worker-cpu"},
            "gpu": {"enabled": False},
            "replicas": 1,
        },
    ],
    "aliases": {"fast": "llama-8b"},
    "auto": {"default": "fast", "rules": [{"use": "llama-8b-cpu", "max_tokens_over": 512}]},
}


def test_each_pool_is_a_statefulset_and_a_service_the_gateways_config_names() -> None:
    objects = render(TWO_POOLS)
    for obj in objects:
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
    gateway = one(objects, "Deployment", "gateway")
    env = environment(objects, gateway)
    addresses = [urlsplit(a) for a in env["LLMGATE_WORKERS"].split(",")]
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service", "worker")}
    sets = {s["metadata"]["name"]: s for s in of_kind(objects, "StatefulSet", "worker")}
    assert len(sets) == len(services) == len(addresses) == 2
    for pool, address in zip(TWO_POOLS["pools"], addresses, strict=True):
        workers = sets[f"demo-llmgate-worker-{pool['name']}"]
        service = services[(address.hostname or "").split(".")[0]]
        assert workers["spec"]["serviceName"] == service["metadata"]["name"]
        assert workers["spec"]["replicas"] == pool["replicas"]
        pod_labels = workers["spec"]["template"]["metadata"]["labels"]
        assert selects(service["spec"]["selector"], pod_labels)
        # Each service selects its own pool's pods only.
        others = [s for s in sets.values() if s is not workers]
        assert not any(
            selects(service["spec"]["selector"], o["spec"]["template"]["metadata"]["labels"])
            for o in others
        )
        c = container(workers)
        assert {"name": "LLMGATE_POOL", "value": pool["name"]} in c["env"]
        args = c["args"]
        assert args[args.index("--served-model-name") + 1] == pool["servedModelName"]
        if "model" in pool:
            assert args[args.index("--model") + 1] == pool["model"]
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (None if pool["name"] == "small-cpu" else 1)
    # The gateway reads the same pools, aliases and auto rules (shared/config.py).
    (pools_map,) = [c for c in of_kind(objects, "ConfigMap") if "pools.yaml" in c["data"]]
    parsed = config.parse(pools_map["data"]["pools.yaml"], "pools.yaml")
    assert [(p.name, p.model_name, p.tier) for p in parsed.pools] == [
        ("small", "llama-8b", 1),
        ("small-cpu", "llama-8b-cpu", 2),
    ]
    assert parsed.pools[0].spill_after == 0 and parsed.pools[1].substitute_for == ["llama-8b"]
    assert parsed.aliases == {"fast": "llama-8b"}
    assert parsed.auto is not None and parsed.auto.rules[0].max_tokens_over == 512
    mounts = {m["name"]: m["mountPath"] for m in container(gateway)["volumeMounts"]}
    assert env["LLMGATE_CONFIG"] == f"{mounts['pools']}/pools.yaml"


@pytest.mark.parametrize(
    "values",
    [
        {"pools": [{"name": "Not_A_DNS_Label"}]},
        {"pools": [{"name": "a", "tier": 0}]},
        {"worker": {"replicas": "two"}},
        {"gateway": {"prot": 8000}},
        {"worker": {"port": 0}},
        {"gateway": {"autoscaling": {"targetCPUUtilizationPercentage": 150}}},
        {"gateway": {"cache": {"url": "memcached://cache:11211"}}},
        {"gateway": {"cache": {"scope": "sometimes"}}},
        {"gateway": {"cache": {"ttl": -1}}},
        {"state": {"database": {"url": "mysql://db:3306/llmgate"}}},
        {"state": {"database": {"existingSecret": "my-db", "key": ""}}},
        {"state": {"databse": {"url": "postgresql://db/llmgate"}}},
        {"postgresql": {"auth": {"password": "p@ss/word"}}},
        {"postgresql": {"auth": {"username": "Robert'); DROP TABLE"}}},
        {"postgresql": {"persistance": {"enabled": False}}},
    ],
)
def test_the_values_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_helm_lint_finds_no_error() -> None:
    result = helm.lint(str(CHART))
    assert result["errors"] == []
    assert not [m for m in result["messages"] if m["severity"] > 1], result["messages"]


# -- The shared state store ------------------------------------------------------


def volumes_of(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}


def state_db_ref(workload: dict[str, Any]) -> dict[str, str] | None:
    """The secretKeyRef that LLMGATE_STATE_DB comes from, if the container has it."""
    for variable in container(workload).get("env", []):
        if variable["name"] == "LLMGATE_STATE_DB":
            assert set(variable) == {"name", "valueFrom"}, "a URL carries its password: a Secret"
            ref = variable["valueFrom"]["secretKeyRef"]
            assert isinstance(ref, dict)
            return ref
    return None


def test_gateways_take_the_state_store_from_a_secret_and_keep_no_state_of_their_own(
    rendered: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    values, objects = rendered
    gateway = one(objects, "Deployment", "gateway")
    ref = state_db_ref(gateway)
    mounts = {m["mountPath"]: m["name"] for m in container(gateway)["volumeMounts"]}
    state_dir = "/var/lib/llmgate"  # the image's LLMGATE_STATE_DIR
    assert "LLMGATE_STATE_DB" in env_names(GatewaySettings)
    if ref is None:  # one gateway, its own SQLite: the only render without a store
        assert values is VALUE_SETS["one-gateway-no-store"]
        assert gateway["spec"]["replicas"] == 1
        assert volumes_of(gateway)[mounts[state_dir]] == {"name": "state", "emptyDir": {}}
        return
    assert "state" not in volumes_of(gateway) and state_dir not in mounts
    assert [v for v in volumes_of(gateway).values() if "emptyDir" in v] == [
        {"name": "tmp", "emptyDir": {}}
    ]
    secrets = {s["metadata"]["name"]: s for s in of_kind(objects, "Secret")}
    existing = values.get("state", {}).get("database", {}).get("existingSecret")
    if existing:
        assert ref == {"name": existing, "key": values["state"]["database"]["key"]}
        assert existing not in secrets  # the user's, not the chart's
    else:
        url = secrets[ref["name"]]["stringData"][ref["key"]]
        assert urlsplit(url).scheme == "postgresql"
        wanted = values.get("state", {}).get("database", {}).get("url")
        if wanted:
            assert url == wanted
            assert not list(of_kind(objects, "Deployment", "postgresql"))


def test_the_demo_postgresql_is_where_the_gateways_url_points() -> None:
    objects = render({})  # the default: the chart's demo PostgreSQL
    gateway = one(objects, "Deployment", "gateway")
    ref = state_db_ref(gateway)
    assert ref is not None
    secret = one(objects, "Secret", "postgresql")
    assert ref == {"name": secret["metadata"]["name"], "key": "url"}
    url = urlsplit(secret["stringData"]["url"])
    database = one(objects, "Deployment", "postgresql")
    service = one(objects, "Service", "postgresql")
    # The URL names the Service, which selects the database's pod on its port.
    assert url.hostname == f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    (port,) = service["spec"]["ports"]
    assert port["port"] == url.port == 5432
    assert selects(service["spec"]["selector"], database["spec"]["template"]["metadata"]["labels"])
    assert not selects(
        service["spec"]["selector"], gateway["spec"]["template"]["metadata"]["labels"]
    )
    c = container(database)
    assert c["image"] == "postgres:16-alpine"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {port["targetPort"]: 5432}
    # The image makes the user and database the URL names, with the URL's password.
    env = {e["name"]: e for e in c["env"]}
    assert env["POSTGRES_USER"]["value"] == url.username
    assert env["POSTGRES_DB"]["value"] == url.path.lstrip("/")
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"],
        "key": "password",
    }
    assert secret["stringData"]["password"] == url.password and len(url.password or "") >= 16
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"][0] == "pg_isready"
    # One pod on the data volume at a time; the data on the claim.
    assert database["spec"]["replicas"] == 1
    assert database["spec"]["strategy"] == {"type": "Recreate"}
    claim = one(objects, "PersistentVolumeClaim", "postgresql")
    data = volumes_of(database)["data"]
    assert data["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert env["PGDATA"]["value"].startswith(mounts["data"] + "/")


def test_the_demo_postgresql_without_persistence_and_with_a_set_password() -> None:
    objects = render(
        {"postgresql": {"persistence": {"enabled": False}, "auth": {"password": "demo-pw"}}}
    )
    assert not list(of_kind(objects, "PersistentVolumeClaim"))
    data = volumes_of(one(objects, "Deployment", "postgresql"))["data"]
    assert data == {"name": "data", "emptyDir": {}}
    secret = one(objects, "Secret", "postgresql")
    assert secret["stringData"]["password"] == "demo-pw"
    assert urlsplit(secret["stringData"]["url"]).password == "demo-pw"


STORE_VALUES = ("state.database.url", "state.database.existingSecret", "postgresql.enabled")


@pytest.mark.parametrize(
    "gateway",
    [
        {"autoscaling": {"enabled": False}, "replicas": 2},
        {"autoscaling": {"enabled": True, "minReplicas": 1}, "replicas": 1},
    ],
    ids=["two-replicas", "autoscaled"],
)
def test_several_gateways_without_a_shared_store_do_not_render(gateway: dict[str, Any]) -> None:
    values = {"gateway": gateway, "postgresql": {"enabled": False}}
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError) as refused:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert "need a shared state store" in str(refused.value)
    for name in STORE_VALUES:
        assert name in str(refused.value)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"state": {"database": {"url": "postgresql://db/x"}}}, "set postgresql.enabled=false"),
        (
            {
                "state": {"database": {"url": "postgresql://db/x", "existingSecret": "my-db"}},
                "postgresql": {"enabled": False},
            },
            "are both set",
        ),
    ],
    ids=["url-and-the-demo", "url-and-existing-secret"],
)
def test_two_stores_at_once_do_not_render(values: dict[str, Any], says: str) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError) as refused:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert says in str(refused.value)
