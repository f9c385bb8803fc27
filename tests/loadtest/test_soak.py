"""loadtest/soak.py: its request mix, keys and arithmetic (a short soak on the real
engine: tests/integration/test_soak.py)."""

from __future__ import annotations

from pathlib import Path

from loadtest import loadtest, soak
from loadtest.capacity import ProcessSample
from shared import api_keys
from tests.conftest import MODEL


def test_each_kind_is_its_route_streamed_or_whole() -> None:
    shapes = {}
    for kind in soak.KINDS:
        path, body = soak.body_of(kind, MODEL, 1, 2)
        shapes[kind] = (path, bool(body.get("stream")), "messages" in body)
    assert shapes == {
        "completion": ("/v1/completions", False, False),
        "completion-stream": ("/v1/completions", True, False),
        "chat": ("/v1/chat/completions", False, True),
        "chat-stream": ("/v1/chat/completions", True, True),
        "chat-left": ("/v1/chat/completions", True, True),
    }


def test_the_keys_file_limits_only_the_limited_key(tmp_path: Path) -> None:
    users, limited = api_keys.load(soak.keys_file(tmp_path))
    assert (users.name, users.requests_per_minute) == ("soak", 0)
    assert (limited.name, limited.requests_per_minute) == ("limited", soak.LIMITED_RPM)
    assert limited.key_sha256 == api_keys.sha256_hex(soak.LIMITED_KEY)


def test_duration_is_the_soaks_length_under_the_soak_scenario() -> None:
    parse = loadtest.build_parser().parse_args
    args = loadtest.resolve_durations(parse(["--scenario", "soak", "--duration", "7200"]))
    assert args.soak_duration == 7200
    assert loadtest.resolve_durations(parse(["--scenario", "soak"])).soak_duration == 1800
    assert loadtest.resolve_durations(parse([])).duration == loadtest.DEFAULT_DURATION


def test_each_process_gets_its_start_end_and_second_half_slope() -> None:
    # 1 MB a minute for an hour, then flat: the second half's slope is zero.
    samples = [
        ProcessSample(t, "worker/VLLM::Worker", 7, 100.0 + min(t, 1800) / 60, 9)
        for t in range(0, 3601, 60)
    ]
    figures = soak.figures(samples, "worker/VLLM::Worker")
    assert figures["rss_mb_start"] == 100.0 and figures["rss_mb_end"] == 130.0
    assert figures["rss_slope_mb_per_hour_second_half"] == 0
    assert (figures["fds_start"], figures["fds_end"]) == (9, 9)
