"""``llmgate gateway``: the gateway's HTTP server (FastAPI on uvicorn, uvloop, httptools).

With ``--processes N`` uvicorn runs N processes on the one port, each with
its own pool state; the load each sees of the workers comes from the
workers' heartbeats, which every process receives. Settings reach the
processes through ``LLMGATE_*`` environment variables, and Prometheus
metrics through a shared multiprocess directory.

SIGTERM drains: uvicorn stops accepting connections, lets in-flight
requests finish for up to ``--drain-timeout`` seconds, and exits 0. Settings
it refuses end it with status 2, as a bad flag does (``settings.refuse``).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import tempfile
from typing import TYPE_CHECKING

import uvicorn

from gateway import metrics
from shared import settings
from shared.logs import setup_logging

if TYPE_CHECKING:
    from shared.config import Config

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgate gateway",
        description="Serve the OpenAI API over a pool of llmgate workers.",
    )
    settings.add_arguments(parser, settings.GatewaySettings)
    return parser


def main(argv: list[str] | None = None) -> None:
    namespace = build_parser().parse_args(argv)
    gateway = settings.from_namespace(settings.GatewaySettings, namespace)
    try:
        setup_logging(gateway.observability.log_level, gateway.observability.log_format)
    except ValueError as exc:
        settings.refuse(f"llmgate gateway: {exc}")
    from gateway.dispatch.policies import POLICY_NAMES

    if gateway.routing.policy not in POLICY_NAMES:
        settings.refuse(f"--policy must be one of {', '.join(POLICY_NAMES)}")
    log.info("routing policy: %s", gateway.routing.policy)
    _check_keys(gateway)
    config = _check_config(gateway)
    from gateway.cache import merge_config
    from shared.cache_settings import check_cache_settings

    # The file's `cache:` is checked with the file; flags and env win over it.
    cached = merge_config(gateway.caching, config)
    problem = check_cache_settings(cached.cache, cached.cache_scope)
    if problem:
        settings.refuse(f"llmgate gateway: {problem}")
    if gateway.store.state_db:
        from gateway.state import check_url

        problem = check_url(gateway.store.state_db)
        if problem:
            settings.refuse(f"llmgate gateway: {problem}")
    limits = gateway.tenants.limits
    if limits and not limits.startswith(("redis://", "rediss://", "unix://")):
        settings.refuse("llmgate gateway: --limits takes redis://HOST:PORT/DB (empty: per process)")
    if gateway.http.timeout_keep_alive < 1:
        settings.refuse("llmgate gateway: --timeout-keep-alive must be at least 1 second")
    if gateway.batch.batch_lease_seconds < 3:
        settings.refuse("llmgate gateway: --batch-lease-seconds must be at least 3")
    if gateway.store.background_lease_seconds < 3:
        settings.refuse("llmgate gateway: --background-lease-seconds must be at least 3")
    # The app factory reads its settings from the environment, in this
    # process or in uvicorn's worker processes alike.
    os.environ.update(settings.to_environment(gateway))
    multiproc_dir = None
    if gateway.http.processes > 1 and not os.environ.get(metrics.MULTIPROC_ENV):
        multiproc_dir = tempfile.mkdtemp(prefix="llmgate-metrics-")
        os.environ[metrics.MULTIPROC_ENV] = multiproc_dir
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the
    # handler that was set before it started: make that a no-op so a drained
    # gateway exits 0 (a supervisor's "stopped cleanly"), not -15.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore)
    try:
        uvicorn.run(
            "gateway.app:create_app_from_environment",
            factory=True,
            host=gateway.http.host,
            port=gateway.http.port,
            workers=gateway.http.processes,
            loop="uvloop",
            http="httptools",
            log_level=gateway.observability.log_level,
            # uvicorn's lines go through our handler (and format) too.
            log_config=None,
            access_log=False,
            # Nothing here reads the client's address or scheme, so uvicorn's
            # X-Forwarded-* rewriting would be work on every request for nothing.
            proxy_headers=False,
            timeout_graceful_shutdown=int(gateway.http.drain_timeout),
            timeout_keep_alive=gateway.http.timeout_keep_alive,
        )
    finally:
        if multiproc_dir:
            shutil.rmtree(multiproc_dir, ignore_errors=True)


def _check_keys(gateway: settings.GatewaySettings) -> None:
    """Refuse to start on a bad key setting, before uvicorn starts any process."""
    from gateway.api.auth import load_api_keys
    from shared.curve_keys import gateway_curve

    try:
        api_keys = load_api_keys(gateway.tenants)
        curve = gateway_curve(gateway.link)
    except ValueError as exc:  # the messages never quote a key
        settings.refuse(f"llmgate gateway: {exc}")
    log.info(
        "API keys: %s; worker links: %s",
        f"{len(api_keys)} configured" if api_keys else "none (open)",
        "CURVE" if curve else "plaintext",
    )
    if gateway.tenants.protect_metrics:
        log.warning(
            "--protect-metrics (LLMGATE_PROTECT_METRICS) is deprecated and changes nothing: "
            "with API keys, /metrics always takes an admin key"
        )
    if api_keys and not any(entry.admin for entry in api_keys):
        log.warning("API keys: none is an admin key, so /metrics answers 403 to every key")


def _check_config(gateway: settings.GatewaySettings) -> Config | None:
    """Refuse to start on a bad --config file, naming its line and field."""
    path = gateway.routing.config
    if not path:
        return None
    from shared.config import ConfigError, load

    try:
        config = load(path)
    except ConfigError as exc:
        settings.refuse(f"llmgate gateway: {exc}")
    log.info(
        "pools from %s: %s",
        path,
        ", ".join(f"{p.name} ({p.model_name}, tier {p.tier})" for p in config.pools),
    )
    return config


def _ignore(_signum: int, _frame: object) -> None:
    pass


if __name__ == "__main__":
    main()
