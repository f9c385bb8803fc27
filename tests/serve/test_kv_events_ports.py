"""``llmgate serve`` gives each worker of a host its own KV events port (serve/plan.py)."""

from __future__ import annotations

import json

from serve.plan import kv_events_per_worker

CONFIG = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5600",
}


def endpoints(args: list[str]) -> tuple[str, str]:
    value = args[args.index("--kv-events-config") + 1]
    config = json.loads(value)
    return config["endpoint"], config["replay_endpoint"]


def test_each_worker_publishes_on_its_own_port() -> None:
    args = ["--enforce-eager", "--kv-events-config", json.dumps(CONFIG)]
    assert endpoints(kv_events_per_worker(args, 0)) == ("tcp://*:5557", "tcp://*:5600")
    assert endpoints(kv_events_per_worker(args, 2)) == ("tcp://*:5559", "tcp://*:5602")
    assert kv_events_per_worker(args, 2)[0] == "--enforce-eager"


def test_the_equals_form_and_what_is_not_a_tcp_port_are_kept_apart() -> None:
    joined = [f"--kv-events-config={json.dumps(CONFIG | {'replay_endpoint': None})}"]
    (out,) = kv_events_per_worker(joined, 1)
    config = json.loads(out.split("=", 1)[1])
    assert (config["endpoint"], config["replay_endpoint"]) == ("tcp://*:5558", None)
    ipc = ["--kv-events-config", json.dumps(CONFIG | {"endpoint": "ipc:///tmp/kv"})]
    assert json.loads(kv_events_per_worker(ipc, 1)[1])["endpoint"] == "ipc:///tmp/kv"
    assert kv_events_per_worker(["--kv-events-config", "not json"], 1)[1] == "not json"
