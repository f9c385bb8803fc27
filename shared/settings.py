"""Settings: one struct per process kind, read from CLI flags and ``LLMGATE_*`` env.

Each field becomes a flag ``--field-name`` and an environment variable
``LLMGATE_FIELD_NAME``; precedence is flag, then environment, then the
default. The help text lives next to the field (``Annotated`` meta), and the
settings tables of the documentation (``docs/settings.md``) are written from
the same source: ``python -m shared.settings --update docs/settings.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar, get_args, get_origin, get_type_hints

import msgspec

ENV_PREFIX = "LLMGATE_"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# The exit status of a process that refuses its settings: argparse's for a
# usage error, so that ``llmgate serve`` tells a refusal from a crash and
# stops instead of restarting the process (serve/supervisor.py).
SETTINGS_ERROR_STATUS = 2


def _help(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


# Settings several process kinds share, described once.
LogFormat = Annotated[
    str, _help("log line format: text, or json (one object per line, with request_id)")
]
OtlpEndpoint = Annotated[
    str,
    _help(
        "OpenTelemetry collector to send request traces to (OTLP, gRPC unless "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); empty = no tracing"
    ),
]
Cache = Annotated[
    str,
    _help(
        "response cache: empty = off, `memory` (this process), or `redis://HOST:PORT/DB` "
        "(shared by every gateway process and replica)"
    ),
]
CacheTtl = Annotated[float, _help("seconds a cached response is kept")]
CacheMaxBytes = Annotated[
    int, _help("memory cache: most bytes of responses kept; the least recently used go first")
]
CacheScope = Annotated[
    str,
    _help(
        "which requests the cache serves: `deterministic` (temperature 0 or a `seed`), "
        "`greedy` (temperature 0 only) or `all` (sampled ones too)"
    ),
]
StateDir = Annotated[
    str,
    _help(
        "directory for uploaded files and batch jobs (survives restarts); "
        "empty = $XDG_STATE_HOME/llmgate, else ~/.local/state/llmgate"
    ),
]
BatchMaxInflight = Annotated[
    int,
    _help(
        "batch lines in flight at once per gateway process (admission also puts them "
        "behind interactive requests); 0 = a 128th of the healthy workers' slots while "
        "interactive requests come in, half of them after 5 s without any"
    ),
]
MaxFileBytes = Annotated[
    int, _help("largest file `POST /v1/files` accepts (a batch's JSONL input); larger is 413")
]


class GatewaySettings(msgspec.Struct, kw_only=True):
    workers: Annotated[
        str,
        _help("comma-separated worker addresses, e.g. tcp://127.0.0.1:5550,tcp://gpu1:5550"),
    ] = "tcp://127.0.0.1:5550"
    host: Annotated[str, _help("HTTP listen address")] = "127.0.0.1"
    port: Annotated[int, _help("HTTP listen port")] = 8000
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
    request_timeout: Annotated[
        float, _help("seconds a request may run before it is aborted with 504 (0 = no limit)")
    ] = 600.0
    startup_timeout: Annotated[
        float, _help("seconds a request waits for a first healthy worker before 503")
    ] = 5.0
    policy: Annotated[str, _help("routing policy: least-load, prefix or round-robin")] = (
        "least-load"
    )
    prefix_load_factor: Annotated[
        float, _help("prefix policy: most load one worker may take, as a multiple of the mean")
    ] = 1.25
    prefix_load_slack: Annotated[
        int,
        _help(
            "prefix policy: requests over the mean load that a worker may always take for "
            "a conversation it holds (the load factor may allow more)"
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
    resolve_interval: Annotated[
        float, _help("seconds between DNS look-ups of worker host names (new pods join)")
    ] = 10.0
    processes: Annotated[int, _help("gateway processes sharing the HTTP port")] = 1
    max_body_bytes: Annotated[
        int, _help("largest request body accepted; a larger one gets 413 before it is read")
    ] = 16 * 1024 * 1024
    drain_timeout: Annotated[
        float, _help("on SIGTERM, seconds to let in-flight requests finish before exiting")
    ] = 30.0
    max_n: Annotated[int, _help("most choices (`n`) one request may ask for; more is 400")] = 128
    max_stop_sequences: Annotated[
        int, _help("most stop sequences (`stop`) one request may give; more is 400")
    ] = 16
    api_keys: Annotated[
        str,
        _help(
            "comma-separated API keys that clients send as `Authorization: Bearer KEY`; "
            "none here or in --api-keys-file = no authentication"
        ),
    ] = ""
    api_keys_file: Annotated[
        str, _help("file of API keys, one per line, `#` starts a comment; adds to --api-keys")
    ] = ""
    protect_metrics: Annotated[
        bool, _help("with API keys, require one on /metrics too (/health and /ready stay open)")
    ] = False
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
    log_level: Annotated[str, _help("log level: debug, info, warning, error")] = "info"
    log_format: LogFormat = "text"
    otlp_endpoint: OtlpEndpoint = ""
    config: Annotated[
        str,
        _help(
            "pools config file (YAML): aliases, auto routing, tiers and spill-over "
            "between pools; empty = route by the model names workers serve"
        ),
    ] = ""
    cache: Cache = ""
    cache_ttl: CacheTtl = 3600.0
    cache_max_bytes: CacheMaxBytes = 256 * 1024 * 1024
    cache_scope: CacheScope = "deterministic"
    state_dir: StateDir = ""
    batch_max_inflight: BatchMaxInflight = 0
    max_file_bytes: MaxFileBytes = 200 * 1024 * 1024


class WorkerSettings(msgspec.Struct, kw_only=True):
    bind: Annotated[str, _help("ZeroMQ address the worker's ROUTER socket binds")] = (
        "tcp://127.0.0.1:5550"
    )
    worker_id: Annotated[str, _help("name in heartbeats and logs (default: host:pid)")] = ""
    heartbeat_interval: Annotated[float, _help("seconds between worker heartbeats")] = 1.0
    gateway_timeout: Annotated[
        float,
        _help(
            "seconds without hearing from a gateway before its requests are aborted "
            "(a gateway whose connection drops has them aborted at once)"
        ),
    ] = 30.0
    drain_timeout: Annotated[
        float, _help("on SIGTERM, seconds to let running requests finish before exiting")
    ] = 30.0
    metrics_port: Annotated[
        int, _help("port of this worker's Prometheus /metrics (vLLM's own metrics); 0 = off")
    ] = 0
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
    pool: Annotated[
        str, _help("pool this worker belongs to (--config's pool name), told to gateways")
    ] = ""
    log_format: LogFormat = "text"
    # The log level is vLLM's own --log-level flag (DEBUG, INFO, ...).


class ServeSettings(msgspec.Struct, kw_only=True):
    host: Annotated[str, _help("HTTP listen address of the gateway")] = "127.0.0.1"
    port: Annotated[int, _help("HTTP listen port of the gateway")] = 8000
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
    config: Annotated[
        str,
        _help(
            "pools config file (YAML): models, workers and devices per pool, aliases, "
            "auto routing, tiers; empty = one pool of --num-workers workers"
        ),
    ] = ""
    restart_backoff_max: Annotated[
        float, _help("upper bound in seconds of the backoff between worker restarts")
    ] = 30.0
    log_level: Annotated[str, _help("log level: debug, info, warning, error")] = "info"
    log_format: LogFormat = "text"
    otlp_endpoint: OtlpEndpoint = ""
    cache: Cache = ""
    cache_ttl: CacheTtl = 3600.0
    cache_max_bytes: CacheMaxBytes = 256 * 1024 * 1024
    cache_scope: CacheScope = "deterministic"
    state_dir: StateDir = ""
    batch_max_inflight: BatchMaxInflight = 0


S = TypeVar("S", bound=msgspec.Struct)


def resolve_state_dir(state_dir: str) -> Path:
    """``--state-dir``, or where the XDG base directory spec puts an app's state."""
    if state_dir:
        return Path(state_dir).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "state"
    return base / "llmgate"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _base_type(annotation: Any) -> Any:
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _description(annotation: Any) -> str:
    for meta in get_args(annotation)[1:] if get_origin(annotation) is Annotated else ():
        if isinstance(meta, msgspec.Meta) and meta.description:
            return meta.description
    return ""


def _parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def fields(cls: type[msgspec.Struct]) -> list[tuple[str, type, Any, str]]:
    """(name, type, default, help) for every setting of ``cls``."""
    hints = get_type_hints(cls, include_extras=True)
    out = []
    for field in msgspec.structs.fields(cls):
        annotation = hints[field.name]
        out.append((field.name, _base_type(annotation), field.default, _description(annotation)))
    return out


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type[msgspec.Struct],
    *,
    title: str = "",
    description: str | None = None,
    skip: Collection[str] = (),
) -> None:
    """Add one flag per field of ``cls`` but those in ``skip``, in a help group
    named ``title``; defaults come from the environment first."""
    group = parser.add_argument_group(
        title or f"{cls.__name__} (flags or {ENV_PREFIX}* variables)", description
    )
    for name, kind, default, help_text in fields(cls):
        if name in skip:
            continue
        env = env_name(name)
        text = f"{help_text} [env {env}; default {default!r}]"
        if kind is bool:
            group.add_argument(
                _flag(name),
                dest=name,
                type=_parse_bool,
                nargs="?",
                const=True,
                default=argparse.SUPPRESS,
                help=text,
            )
        else:
            group.add_argument(
                _flag(name), dest=name, type=kind, default=argparse.SUPPRESS, help=text
            )


def given_flags(namespace: argparse.Namespace, names: Collection[str]) -> list[str]:
    """The flags among ``names`` given on the command line parsed into ``namespace``
    (``add_arguments`` leaves the others out), as ``--name=value`` for another process."""
    flags = []
    for name in names:
        if hasattr(namespace, name):
            value = getattr(namespace, name)
            shown = ("true" if value else "false") if isinstance(value, bool) else str(value)
            flags.append(f"{_flag(name)}={shown}")
    return flags


def refuse(message: str) -> NoReturn:
    """Print ``message`` on stderr and exit with ``SETTINGS_ERROR_STATUS``."""
    print(message, file=sys.stderr, flush=True)
    raise SettingsRefused(message)


class SettingsRefused(SystemExit):
    """A process refusing its settings (``refuse``): ``str()`` is the message."""

    def __init__(self, message: str) -> None:
        super().__init__(SETTINGS_ERROR_STATUS)
        self.message = message

    def __str__(self) -> str:
        return self.message


def to_environment(instance: msgspec.Struct) -> dict[str, str]:
    """``LLMGATE_*`` variables that reproduce ``instance`` (for child processes)."""
    out = {}
    for name, kind, _default, _help_text in fields(type(instance)):
        value = getattr(instance, name)
        out[env_name(name)] = ("1" if value else "0") if kind is bool else str(value)
    return out


def from_environment(cls: type[S]) -> S:
    """``cls`` from ``LLMGATE_*`` variables and defaults alone."""
    return from_namespace(cls, argparse.Namespace())


def from_namespace(cls: type[S], namespace: argparse.Namespace) -> S:
    """Build ``cls`` from parsed flags, falling back to ``LLMGATE_*`` env, then defaults."""
    values: dict[str, Any] = {}
    for name, kind, _default, _help_text in fields(cls):
        if hasattr(namespace, name):
            values[name] = getattr(namespace, name)
            continue
        raw = os.environ.get(env_name(name))
        if raw is None:
            continue
        try:
            values[name] = _parse_bool(raw) if kind is bool else kind(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            refuse(f"invalid {env_name(name)}={raw!r}: {exc}")
    return cls(**values)


def markdown_table(cls: type[msgspec.Struct]) -> str:
    """The documentation's table of ``cls``'s settings (Markdown)."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name, _kind, default, help_text in fields(cls):
        shown = f"`{default}`" if default != "" else "(see meaning)"
        rows.append(f"| `{_flag(name)}` | `{env_name(name)}` | {shown} | {help_text} |")
    return "\n".join(rows)


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
