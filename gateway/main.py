"""``llmgate gateway``: one gateway process (FastAPI on uvicorn, uvloop, httptools)."""

from __future__ import annotations

import argparse

import uvicorn

from gateway.app import create_app
from shared import settings
from shared.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgate gateway",
        description="Serve the OpenAI API over a pool of llmgate workers.",
    )
    settings.add_arguments(parser, settings.GatewaySettings)
    return parser


def main(argv: list[str] | None = None) -> None:
    namespace = build_parser().parse_args(argv)
    gateway_settings = settings.from_namespace(settings.GatewaySettings, namespace)
    setup_logging(gateway_settings.log_level)
    uvicorn.run(
        create_app(gateway_settings),
        host=gateway_settings.host,
        port=gateway_settings.port,
        loop="uvloop",
        http="httptools",
        log_level=gateway_settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
    )


if __name__ == "__main__":
    main()
