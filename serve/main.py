"""``llmgate serve``: start workers and a gateway (``serve.plan``), keep them
running (``serve.supervisor``); ``python -m serve`` is the same command."""

from __future__ import annotations

import argparse
import sys

from serve.plan import SERVE_DECIDES, SHARED_FLAGS, plan_children
from serve.supervisor import Supervisor
from shared import settings
from shared.cache_settings import check_cache_settings
from shared.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgate serve",
        description="Start workers and a gateway and keep them running; a child that "
        "fails its start (exits before it is ever ready: a bad flag or setting) stops "
        "it with the child's message. "
        "The gateway's settings go to the gateway; unknown flags are passed to every "
        "worker (vLLM engine flags).",
        # An abbreviation of one of our flags is an engine flag's whole name
        # as often as not: whatever is not exactly ours goes to the workers.
        allow_abbrev=False,
    )
    settings.add_arguments(parser, settings.ServeSettings)
    settings.add_arguments(
        parser,
        settings.GatewaySettings,
        title=f"GatewaySettings, passed to the gateway (flags or {settings.ENV_PREFIX}* variables)",
        description=f"{' and '.join('--' + n.replace('_', '-') for n in SHARED_FLAGS)} go to "
        "the workers too; --workers is not taken: the gateway's workers are those serve starts.",
        skip=SERVE_DECIDES,
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    namespace, engine_args = build_parser().parse_known_args(argv)
    serve = settings.from_namespace(settings.ServeSettings, namespace)
    try:
        setup_logging(serve.observability.log_level, serve.observability.log_format)
    except ValueError as exc:
        settings.refuse(f"llmgate serve: {exc}")
    # The gateway's settings as its own parser will read them (flags, then
    # LLMGATE_* variables): its cache is checked before anything starts.
    caching = settings.from_namespace(settings.GatewaySettings, namespace).caching
    problem = check_cache_settings(caching.cache, caching.cache_scope)
    if problem:
        settings.refuse(f"llmgate serve: {problem}")
    children = plan_children(serve, namespace, engine_args)
    sys.exit(Supervisor(serve, children).run())


if __name__ == "__main__":
    main()
