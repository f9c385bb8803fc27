"""The rolling scenario's reading of streams and of the gateway's metrics."""

from __future__ import annotations

from loadtest.capacity import StreamResult
from loadtest.rolling import failed, moved, phase_report

PAGE = """\
# HELP llmgate_migrations_total Streams moved
# TYPE llmgate_migrations_total counter
llmgate_migrations_total{reason="worker_draining"} 7.0
llmgate_migrations_total{reason="worker_lost"} 1.0
# HELP llmgate_migrated_tokens_total Tokens handed on
# TYPE llmgate_migrated_tokens_total counter
llmgate_migrated_tokens_total 212.0
"""


def test_moves_and_tokens_are_read_from_the_metrics_page() -> None:
    assert moved(PAGE) == {"worker_draining": 7.0, "worker_lost": 1.0, "tokens": 212.0}


def test_only_a_whole_stream_is_not_an_error() -> None:
    whole = StreamResult(status=200, tokens=64, done=True, seconds=1.0, first_token_s=0.1)
    assert not failed(whole, 64)
    assert failed(StreamResult(status=200, tokens=64, done=True, error="cut"), 64)
    assert failed(StreamResult(status=200, tokens=30, done=True), 64)
    assert failed(StreamResult(status=200, tokens=64, done=False), 64)
    assert failed(StreamResult(status=503), 64)
    report = phase_report([(0.0, whole), (1.0, StreamResult(status=503))], 64)
    assert report["streams"] == 2 and report["errors"] == 1
    assert report["latency_p99_s"] == 1.0 and report["ttft_p50_s"] == 0.1
