"""``loadtest.wrk``: the scenarios' bodies, wrk's Lua script and output, /proc figures."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadtest import wrk
from loadtest.wrk import Scenario
from tests.conftest import ROOT, free_port

MODEL = "smollm2-135m-instruct"


def test_scenarios_ask_for_what_they_measure() -> None:
    by_name = wrk.scenarios(connections=32, stream_tokens=8)
    assert by_name["latency"] == Scenario("latency", 1, False, 1)
    assert by_name["throughput"].connections == 32
    body = json.loads(by_name["stream"].body())
    assert body["stream"] is True and body["max_tokens"] == 8 and body["model"] == MODEL


def test_wrk_script_posts_the_body_and_prints_json() -> None:
    script = wrk.wrk_script(b'{"prompt":"a \\"quoted\\" word"}')
    assert 'wrk.method = "POST"' in script
    assert 'wrk.body = [==[{"prompt":"a \\"quoted\\" word"}]==]' in script
    assert "done = function(summary, latency, requests)" in script
    with pytest.raises(ValueError):
        wrk.wrk_script(b'{"prompt":"]==]"}')


def test_parse_wrk_reads_the_marker_line() -> None:
    output = "Running 1s test\n" + wrk.WRK_MARKER + '{"requests":10,"errors_status":2}\n'
    figures = wrk.parse_wrk(output)
    assert figures["requests"] == 10
    assert wrk.wrk_errors({"requests": 10, "errors_status": 2, "errors_read": 1}) == 3
    with pytest.raises(ValueError):
        wrk.parse_wrk("Running 1s test\n")


def test_wrk_script_runs_under_wrk(tmp_path: Path) -> None:
    """The Lua really runs: wrk POSTs the body and prints one parseable JSON line."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "loadtest.zero_cost_http", "--port", str(port)], cwd=ROOT
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")
        script = tmp_path / "s.lua"
        script.write_text(wrk.wrk_script(Scenario("t", 1, False, 3).body()))
        done = subprocess.run(
            [
                "wrk",
                "-t1",
                "-c1",
                "-d3s",
                "-s",
                str(script),
                f"http://127.0.0.1:{port}/v1/completions",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        server.terminate()
        server.wait(10)
    figures = wrk.parse_wrk(done.stdout)
    assert figures["requests"] > 0 and wrk.wrk_errors(figures) == 0
    assert 0 < figures["latency_mean_us"] < 1e6


def test_status_field_reads_proc_status() -> None:
    text = "Name:\tpython\nVmHWM:\t  123456 kB\nVmRSS:\t  100000 kB\n"
    assert wrk.status_field(text, "VmHWM") == 123456
    assert wrk.status_field(text, "VmRSS") == 100000
    with pytest.raises(ValueError):
        wrk.status_field(text, "VmSwap")


def _wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not up after {timeout}s")
