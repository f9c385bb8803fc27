"""shared/logs.py: the request id on log lines, and the JSON format."""

from __future__ import annotations

import json
import logging

import pytest

from shared import logs


@pytest.fixture
def captured(capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield capsys
    root.handlers[:] = handlers
    root.setLevel(level)


def test_text_lines_end_with_the_request_id_inside_a_request(captured) -> None:  # type: ignore[no-untyped-def]
    logs.setup_logging("info", "text")
    log = logging.getLogger("test.logs")
    log.info("outside")
    with logs.for_request("abc-1"):
        log.info("inside")
    err = captured.readouterr().err.splitlines()
    assert err[0].endswith("test.logs: outside")
    assert err[1].endswith("test.logs: inside [request_id=abc-1]")


def test_json_lines_are_objects_with_the_request_id(captured) -> None:  # type: ignore[no-untyped-def]
    logs.setup_logging("info", "json")
    log = logging.getLogger("test.logs")
    with logs.for_request("abc-2"):
        log.warning('quote " and newline\n here')
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in captured.readouterr().err.splitlines())
    assert first["request_id"] == "abc-2" and first["level"] == "WARNING"
    assert first["message"] == 'quote " and newline\n here'
    assert "request_id" not in second and "ValueError: boom" in second["exception"]


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="--log-format"):
        logs.setup_logging("info", "xml")
