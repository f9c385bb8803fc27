"""Settings: one struct per process kind, read from CLI flags and ``LLMGATE_*`` env.

A process kind's settings are grouped by component (``GatewaySettings.admission``,
``.routing``, ...), and each component takes its own group. Each leaf setting
is a flag ``--field-name`` and an environment variable ``LLMGATE_FIELD_NAME``
whatever its group; precedence is flag, then environment, then the default
(``shared.flags`` does that). The help text lives next to the field
(``Annotated`` meta), and the settings tables of the documentation
(``docs/settings.md``) are written from the same source:
``python -m shared.settings --update docs/settings.md``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import msgspec

from shared.flags import (
    ENV_PREFIX,
    SETTINGS_ERROR_STATUS,
    Settings,
    SettingsRefused,
    add_arguments,
    env_name,
    fields,
    from_environment,
    from_namespace,
    given_flags,
    groups,
    own_fields,
    refuse,
    to_environment,
)
from shared.flags import _flag as flag_name

__all__ = [
    "ENV_PREFIX",
    "SECRET_SETTINGS",
    "SETTINGS_ERROR_STATUS",
    "AdmissionSettings",
    "BatchSettings",
    "CacheSettings",
    "EngineSettings",
    "GatewaySettings",
    "HttpSettings",
    "LinkSettings",
    "ObservabilitySettings",
    "RoutingSettings",
    "ServeSettings",
    "Settings",
    "SettingsRefused",
    "StoreSettings",
    "TenantSettings",
    "WorkerLinkSettings",
    "WorkerSettings",
    "add_arguments",
    "env_name",
    "fields",
    "from_environment",
    "from_namespace",
    "given_flags",
    "refuse",
    "resolve_state_dir",
    "to_environment",
]

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"

# Settings whose values are secrets (API keys) or URLs that may carry a
# password: ``llmgate serve`` hands them to its children as ``LLMGATE_*``
# variables, never on a command line (any user of the machine can read one
# in /proc, and serve logs its children's), and a log shows such a URL only
# through ``shared.redact``.
SECRET_SETTINGS = frozenset({"api_keys", "state_db", "limits", "cache", "otlp_endpoint"})


def _help(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


# The log format, which gateways, workers and serve all take.
LogFormat = Annotated[
    str, _help("log line format: text, or json (one object per line, with request_id)")
]


class HttpSettings(Settings):
    """The HTTP server and the limits of one request."""

    host: Annotated[str, _help("HTTP listen address")] = "127.0.0.1"
    port: Annotated[int, _help("HTTP listen port")] = 8000
    processes: Annotated[int, _help("gateway processes sharing the HTTP port")] = 1
    max_body_bytes: Annotated[
        int, _help("largest request body accepted; a larger one gets 413 before it is read")
    ] = 16 * 1024 * 1024
    max_n: Annotated[int, _help("most choices (`n`) one request may ask for; more is 400")] = 128
    max_stop_sequences: Annotated[
        int, _help("most stop sequences (`stop`) one request may give; more is 400")
    ] = 16
    request_timeout: Annotated[
        float, _help("seconds a request may run before it is aborted with 504 (0 = no limit)")
    ] = 600.0
    drain_timeout: Annotated[
        float, _help("on SIGTERM, seconds to let in-flight requests finish before exiting")
    ] = 30.0
    timeout_keep_alive: Annotated[
        int,
        _help(
            "seconds an idle client connection stays open; keep it above the idle timeout "
            "of a load balancer in front (AWS ALB: 60 s), so the balancer closes first and "
            "never sends a request on a connection the gateway is closing"
        ),
    ] = 75


class LinkSettings(Settings):
    """The workers: where they are, their links (CURVE) and heartbeats."""

    workers: Annotated[
        str,
        _help("comma-separated worker addresses, e.g. tcp://127.0.0.1:5550,tcp://gpu1:5550"),
    ] = "tcp://127.0.0.1:5550"
    resolve_interval: Annotated[
        float, _help("seconds between DNS look-ups of worker host names (new pods join)")
    ] = 10.0
    heartbeat_interval: Annotated[float, _help("seconds between gateway pings")] = 1.0
    heartbeat_timeout: Annotated[
        float,
        _help("seconds a worker may send nothing (heartbeats, output) before it is marked down"),
    ] = 3.0
    stall_timeout: Annotated[
        float,
        _help(
            "seconds of silence a worker's requests that cannot go elsewhere (streams already "
            "under way; requests no other worker could take) wait out: marked down after "
            "--heartbeat-timeout, it may only be stalled, and heard from again in time they "
            "carry on whole; past this they end with an error (at or below "
            "--heartbeat-timeout: when it is marked down)"
        ),
    ] = 30.0
    startup_timeout: Annotated[
        float, _help("seconds a request waits for a first healthy worker before 503")
    ] = 5.0
    curve_gateway_key_file: Annotated[
        str,
        _help(
            "this gateway's CURVE key file (NAME.key_secret from `llmgate keys generate`); "
            "with --curve-worker-public-key-file, worker links are encrypted; empty = plaintext"
        ),
    ] = ""
    curve_worker_public_key_file: Annotated[
        str, _help("the workers' CURVE public key file (NAME.key); every worker has this key")
    ] = ""


class AdmissionSettings(Settings):
    """The waiting line for a free worker slot, and fair sharing."""

    max_queue: Annotated[
        int, _help("requests that may wait for a free worker slot; past it, 429")
    ] = 1024
    queue_timeout: Annotated[
        float, _help("seconds a request may wait for a free worker slot before 429")
    ] = 30.0
    max_inflight_per_worker: Annotated[
        int,
        _help(
            "cap on requests in flight per worker; 0 = the capacity it reports "
            "(vLLM's max-num-seqs)"
        ),
    ] = 0
    fair_share: Annotated[
        bool,
        _help(
            "with API keys, a freed worker slot goes to the waiting request whose key has "
            "used the fewest tokens lately (per process), not to the first in line "
            "(docs: tenants)"
        ),
    ] = True


class RoutingSettings(Settings):
    """The pools file, the policy that picks a worker, and retries."""

    config: Annotated[
        str,
        _help(
            "pools config file (YAML): aliases, auto routing, tiers and spill-over "
            "between pools; empty = route by the model names workers serve"
        ),
    ] = ""
    policy: Annotated[
        str,
        _help(
            "routing policy: least-load, prefix, round-robin, or kv (by the engines' KV "
            "cache events: workers run with --kv-events-config)"
        ),
    ] = "least-load"
    prefix_load_factor: Annotated[
        float,
        _help(
            "prefix and kv policies (and hinted requests): most load one worker may take, "
            "as a multiple of the mean"
        ),
    ] = 1.25
    prefix_load_slack: Annotated[
        int,
        _help(
            "prefix and kv policies: requests over the mean load that a worker may always "
            "take for a conversation it holds (the load factor may allow more)"
        ),
    ] = 4
    prefix_chars: Annotated[
        int,
        _help(
            "prefix policy: characters of the prompt (of a chat's system prompt and "
            "first message) that make the affinity key"
        ),
    ] = 256
    max_retries: Annotated[
        int,
        _help(
            "times a request is re-sent when its worker fails it (lost, draining, or it "
            "dropped it) before any output"
        ),
    ] = 2
    max_migrations: Annotated[
        int,
        _help(
            "times a stream moves on to another worker when its worker fails it mid-answer, "
            "continuing from the tokens already sent (0: it ends with an error event)"
        ),
    ] = 2


class CacheSettings(Settings):
    """The response cache."""

    cache: Annotated[
        str,
        _help(
            "response cache: empty = off, `memory` (this process), or `redis://HOST:PORT/DB` "
            "(shared by every gateway process and replica)"
        ),
    ] = ""
    cache_ttl: Annotated[float, _help("seconds a cached response is kept")] = 3600.0
    cache_max_bytes: Annotated[
        int, _help("memory cache: most bytes of responses kept; the least recently used go first")
    ] = 256 * 1024 * 1024
    cache_scope: Annotated[
        str,
        _help(
            "which requests the cache serves: `deterministic` (temperature 0 or a `seed`), "
            "`greedy` (temperature 0 only) or `all` (sampled ones too)"
        ),
    ] = "deterministic"


class StoreSettings(Settings):
    """The state store (files, batch jobs, stored responses), and how long they are kept."""

    state_dir: Annotated[
        str,
        _help(
            "directory for the state store's SQLite database (files, batch jobs, stored "
            "responses; survives restarts) when no --state-db is given; "
            "empty = $XDG_STATE_HOME/llmgate, else ~/.local/state/llmgate"
        ),
    ] = ""
    state_db: Annotated[
        str,
        _help(
            "PostgreSQL URL (postgresql://USER:PASSWORD@HOST:PORT/DB) of the state store "
            "every gateway replica shares: files, batch jobs, stored responses; empty = "
            "SQLite in --state-dir, shared by the gateway processes of one host"
        ),
    ] = ""
    responses_days: Annotated[
        float,
        _help("days a stored response (Responses API, store: true) is kept, as OpenAI's 30"),
    ] = 30.0
    background_events_hours: Annotated[
        float,
        _help(
            "hours a background response (Responses API, background: true) keeps its "
            "stream's events for a client to resume from (starting_after); its stored "
            "response is kept --responses-days"
        ),
    ] = 24.0
    background_lease_seconds: Annotated[
        float,
        _help(
            "seconds a background response stays with the gateway process running it, "
            "renewed every third of it: a replica that dies leaves its responses to the "
            "others after at most this long (at least 3)"
        ),
    ] = 30.0
    batch_output_days: Annotated[
        float,
        _help("days a batch's output and error files are kept; 0 = until deleted"),
    ] = 30.0


class TenantSettings(Settings):
    """API keys and their limits."""

    api_keys: Annotated[
        str,
        _help(
            "comma-separated API keys that clients send as `Authorization: Bearer KEY`; "
            "none here or in --api-keys-file = no authentication"
        ),
    ] = ""
    api_keys_file: Annotated[
        str,
        _help(
            "file of API keys: one per line (`#` starts a comment), or YAML with names, "
            "limits, budgets, models, band and admin per key (docs: tenants); re-read when it "
            "changes; adds to --api-keys"
        ),
    ] = ""
    # Kept so that deployments that set it still start.
    protect_metrics: Annotated[
        bool,
        _help(
            "deprecated, changes nothing: with API keys, /metrics always takes an admin "
            "key (/health and /ready stay open)"
        ),
    ] = False
    limits: Annotated[
        str,
        _help(
            "where API keys' limits are counted: empty = in each process, or "
            "`redis://HOST:PORT/DB` (shared by every process and replica; while it does "
            "not answer, each process counts on its own)"
        ),
    ] = ""
    limits_timeout: Annotated[
        float,
        _help(
            "seconds a request waits for the --limits Redis before its process counts "
            "on its own (and tries Redis again 5 s later)"
        ),
    ] = 0.5
    file_quota_bytes: Annotated[
        int,
        _help(
            "most bytes of uploaded files one API key may keep stored at once (0: no "
            "limit); an upload past it is 413 until the key deletes files"
        ),
    ] = 2 * 1024 * 1024 * 1024


class BatchSettings(Settings):
    """Batch jobs and their files."""

    batch_max_inflight: Annotated[
        int,
        _help(
            "batch lines in flight at once per gateway process (admission also puts them "
            "behind interactive requests); 0 = a 128th of the healthy workers' slots while "
            "interactive requests come in, half of them after 5 s without any"
        ),
    ] = 0
    batch_lease_seconds: Annotated[
        float,
        _help(
            "seconds a batch line stays with the gateway process running it, renewed every "
            "third of it while the line runs: a replica that dies leaves its lines to the "
            "others after at most this long (at least 3)"
        ),
    ] = 30.0
    max_file_bytes: Annotated[
        int, _help("largest file `POST /v1/files` accepts (a batch's JSONL input); larger is 413")
    ] = 200 * 1024 * 1024


class ObservabilitySettings(Settings):
    """Logs and traces."""

    log_level: Annotated[str, _help("log level: debug, info, warning, error")] = "info"
    log_format: LogFormat = "text"
    otlp_endpoint: Annotated[
        str,
        _help(
            "OpenTelemetry collector to send request traces to (OTLP, gRPC unless "
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); empty = no tracing"
        ),
    ] = ""


class GatewaySettings(Settings):
    """``llmgate gateway``: one group per component, each given to it whole."""

    http: HttpSettings = msgspec.field(default_factory=HttpSettings)
    link: LinkSettings = msgspec.field(default_factory=LinkSettings)
    admission: AdmissionSettings = msgspec.field(default_factory=AdmissionSettings)
    routing: RoutingSettings = msgspec.field(default_factory=RoutingSettings)
    caching: CacheSettings = msgspec.field(default_factory=CacheSettings)
    store: StoreSettings = msgspec.field(default_factory=StoreSettings)
    tenants: TenantSettings = msgspec.field(default_factory=TenantSettings)
    batch: BatchSettings = msgspec.field(default_factory=BatchSettings)
    observability: ObservabilitySettings = msgspec.field(default_factory=ObservabilitySettings)


class WorkerLinkSettings(Settings):
    """A worker's side of the link: its socket, name, pool and heartbeats, CURVE."""

    bind: Annotated[str, _help("ZeroMQ address the worker's ROUTER socket binds")] = (
        "tcp://127.0.0.1:5550"
    )
    worker_id: Annotated[str, _help("name in heartbeats and logs (default: host:pid)")] = ""
    pool: Annotated[
        str, _help("pool this worker belongs to (--config's pool name), told to gateways")
    ] = ""
    heartbeat_interval: Annotated[float, _help("seconds between worker heartbeats")] = 1.0
    gateway_timeout: Annotated[
        float,
        _help(
            "seconds without hearing from a gateway before its requests are aborted "
            "(a gateway whose connection drops has them aborted at once)"
        ),
    ] = 30.0
    curve_worker_key_file: Annotated[
        str,
        _help(
            "this worker's CURVE key file (NAME.key_secret from `llmgate keys generate`); "
            "set, only gateways with a key in --curve-gateway-keys-dir get in; empty = plaintext"
        ),
    ] = ""
    curve_gateway_keys_dir: Annotated[
        str,
        _help("directory of the public key files (*.key) of the gateways this worker accepts"),
    ] = ""


class EngineSettings(Settings):
    """What the worker asks of its engine."""

    max_input_tokens: Annotated[
        int, _help("longest prompt in tokens, else 400 (TGI's flag); 0 = the model's context")
    ] = 0
    max_total_tokens: Annotated[
        int,
        _help(
            "most prompt + generated tokens per request, else 400 (TGI's flag); "
            "0 = the model's context"
        ),
    ] = 0
    engine_busy_wait: Annotated[
        float,
        _help(
            "CPU engines: seconds a vLLM process spins waiting for the next step before it "
            "sleeps (vLLM's own window, 1 s, keeps a second core busy for as long as the "
            "model computes); GPU engines keep vLLM's window"
        ),
    ] = 0.002


class WorkerSettings(Settings):
    """``llmgate worker``."""

    drain_timeout: Annotated[
        float, _help("on SIGTERM, seconds to let running requests finish before exiting")
    ] = 30.0
    metrics_port: Annotated[
        int, _help("port of this worker's Prometheus /metrics (vLLM's own metrics); 0 = off")
    ] = 0
    log_format: LogFormat = "text"
    # The log level is vLLM's own --log-level flag (DEBUG, INFO, ...).
    link: WorkerLinkSettings = msgspec.field(default_factory=WorkerLinkSettings)
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)


class ServeSettings(Settings):
    """``llmgate serve``: its own settings and its logging; it takes the
    gateway's groups too and hands them on (``serve.plan``)."""

    host: Annotated[str, _help("HTTP listen address of the gateway")] = "127.0.0.1"
    port: Annotated[int, _help("HTTP listen port of the gateway")] = 8000
    config: Annotated[
        str,
        _help(
            "pools config file (YAML): models, workers and devices per pool, aliases, "
            "auto routing, tiers; empty = one pool of --num-workers workers"
        ),
    ] = ""
    cpu_preload: Annotated[
        bool,
        _help(
            "CPU workers: LD_PRELOAD tcmalloc and Intel's OpenMP runtime where installed, as "
            "vLLM's CPU guide recommends (off: it measured no faster here; an LD_PRELOAD in "
            "the environment wins)"
        ),
    ] = False
    num_workers: Annotated[
        int, _help("CPU workers to start when no GPU is visible (GPUs: one worker each)")
    ] = 1
    worker_base_port: Annotated[
        int, _help("ZeroMQ port of worker 0; worker i binds base+i on 127.0.0.1")
    ] = 5550
    worker_metrics_port: Annotated[
        int, _help("Prometheus port of worker 0 (vLLM's metrics); worker i uses base+i; 0 = off")
    ] = 0
    device: Annotated[str, _help("auto, cpu or gpu: where the workers run")] = "auto"
    restart_backoff_max: Annotated[
        float, _help("upper bound in seconds of the backoff between worker restarts")
    ] = 30.0
    observability: ObservabilitySettings = msgspec.field(default_factory=ObservabilitySettings)


def resolve_state_dir(state_dir: str) -> Path:
    """``--state-dir``, or where the XDG base directory spec puts an app's state."""
    if state_dir:
        return Path(state_dir).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "state"
    return base / "llmgate"


def markdown_table(cls: type[msgspec.Struct]) -> str:
    """The documentation's tables of ``cls``'s settings (Markdown): its own,
    then one per group, headed by the group's name and docstring."""
    parts = []
    for attribute, group in groups(cls):
        rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
        for name, _kind, default, help_text in own_fields(group):
            shown = f"`{default}`" if default != "" else "(see meaning)"
            rows.append(f"| `{flag_name(name)}` | `{env_name(name)}` | {shown} | {help_text} |")
        if attribute:
            rows.insert(0, f"*{attribute}*: {(group.__doc__ or '').strip()}\n")
        if len(rows) > 2:
            parts.append("\n".join(rows))
    return "\n\n".join(parts)


def update_tables(path: str) -> None:
    """Rewrite the settings tables between ``<!-- settings:Cls -->`` markers in ``path``."""
    with open(path) as file:
        text = file.read()
    for settings_cls in (ServeSettings, GatewaySettings, WorkerSettings):
        begin = f"<!-- settings:{settings_cls.__name__} -->\n"
        end = f"\n<!-- /settings:{settings_cls.__name__} -->"
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = f"{head}{begin}{markdown_table(settings_cls)}{end}{tail}"
    with open(path, "w") as file:
        file.write(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--update"]:
        update_tables(sys.argv[2] if len(sys.argv) > 2 else "docs/settings.md")
    else:
        for settings_cls in (ServeSettings, GatewaySettings, WorkerSettings):
            print(f"{settings_cls.__name__}\n\n{markdown_table(settings_cls)}\n")
