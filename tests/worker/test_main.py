"""``llmgate worker``'s command line."""

from __future__ import annotations

from worker import main as worker_main


def test_the_log_level_defaults_to_info_when_not_given() -> None:
    # vLLM's parser leaves --log-level out of the namespace when it is not
    # given; the worker once crashed on that (AttributeError) at start.
    parser = worker_main.build_parser()
    assert worker_main.log_level(parser.parse_args([])) == "info"
    assert worker_main.log_level(parser.parse_args(["--log-level", "DEBUG"])) == "DEBUG"
