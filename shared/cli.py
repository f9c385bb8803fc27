"""The ``llmgate`` command: dispatches to the subcommand's own module.

Imports are lazy so that ``llmgate gateway`` never imports vLLM or torch
(the gateway image has neither).
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "serve": ("serve.main", "start workers and a gateway, and supervise them"),
    "worker": ("worker.main", "run one worker (vLLM engine behind ZeroMQ)"),
    "gateway": ("gateway.main", "run one gateway (OpenAI HTTP API)"),
    "convert-model": ("worker.embedded_model", "convert the embedded model (done on demand)"),
    "batch": ("gateway.batch.cli", "run a JSONL file of requests as a batch job (OpenAI's format)"),
    "keys": (
        "shared.curve_keys",
        "API keys with limits (add, list, revoke) and CURVE key pairs (generate)",
    ),
}


def usage() -> str:
    lines = ["usage: llmgate {" + ",".join(SUBCOMMANDS) + "} [flags]", ""]
    lines += [f"  {name:<14} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines += ["", "`llmgate SUBCOMMAND --help` lists a subcommand's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if args else 2)
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"llmgate: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(SUBCOMMANDS[name][0])
    module.main(rest)


if __name__ == "__main__":
    main()
