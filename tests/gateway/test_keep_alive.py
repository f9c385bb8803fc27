"""How long the gateway keeps an idle client connection open (``--timeout-keep-alive``).

uvicorn's own default, 5 s, is under every common load balancer's idle
timeout (AWS's ALB: 60 s): the balancer then sends requests on connections
the gateway is closing, and they fail (a 502 to the client). The setting is
read in ``gateway.main`` and handed to uvicorn, whose behaviour it then is;
what is checked here is that hand-over, in a process of its own (``main``
sets signal handlers and the environment), with uvicorn's ``run`` replaced
by one that prints what it was given.
"""

from __future__ import annotations

import os
import subprocess
import sys

from shared.flags import SETTINGS_ERROR_STATUS
from tests.conftest import ROOT

PRINT_KEEP_ALIVE = (
    "import uvicorn; uvicorn.run = lambda *a, **kw: print(kw['timeout_keep_alive']); "
    "from gateway.main import main; main(sys.argv[1:])"
)


def keep_alive_given_to_uvicorn(*flags: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; {PRINT_KEEP_ALIVE}", *flags],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_idle_connection_outlives_a_load_balancers_by_default() -> None:
    assert keep_alive_given_to_uvicorn() == "75"


def test_the_flag_and_the_variable_set_it() -> None:
    assert keep_alive_given_to_uvicorn("--timeout-keep-alive", "620") == "620"
    assert keep_alive_given_to_uvicorn(env={"LLMGATE_TIMEOUT_KEEP_ALIVE": "9"}) == "9"


def test_under_a_second_is_refused_at_start() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.main", "--timeout-keep-alive", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == SETTINGS_ERROR_STATUS
    assert "--timeout-keep-alive must be at least 1 second" in done.stderr
