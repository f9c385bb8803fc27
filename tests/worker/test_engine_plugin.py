"""How long vLLM's processes spin for the next step: the worker's setting, and
the plugin that applies it inside vLLM (worker.engine_plugin). What it does
to a real engine's CPU is tests/integration/test_cpu_layout.py's."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

from shared import settings
from worker import engine_plugin
from worker import main as worker_main


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("", None), ("0.002", 0.002), ("0", 0.0), (" 1 ", 1.0), ("soon", None), ("-1", None)],
)
def test_the_plugin_reads_the_cap_or_keeps_vllms_window(
    value: str, seconds: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert engine_plugin.busy_wait_seconds({engine_plugin.ENV: value}) == seconds
    # A value that is not a number of seconds is said, not silently dropped.
    assert ("not a number of seconds" in caplog.text) == (value in {"soon", "-1"})


def test_the_plugin_caps_a_readers_window_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)  # undone after the test
    monkeypatch.setenv(engine_plugin.ENV, "0.002")
    context = zmq.Context()
    try:
        reader = SpinCondition(
            is_reader=True, context=context, notify_address=f"ipc://{tmp_path}/notify"
        )
        assert reader.busy_loop_s == 1  # vLLM's own window
        engine_plugin.register()
        engine_plugin.register()  # vLLM may load its plugins again: no second wrapper
        reader.wait(timeout_ms=0)
        assert reader.busy_loop_s == 0.002
        assert SpinCondition.wait.llmgate_original.__qualname__ == "SpinCondition.wait"  # type: ignore[attr-defined]
        reader.local_notify_socket.close(linger=0)
        reader.read_cancel_socket.close(linger=0)
        reader.write_cancel_socket.close(linger=0)
    finally:
        context.term()


def test_without_the_variable_the_plugin_leaves_vllm_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    original = SpinCondition.wait
    monkeypatch.setattr(SpinCondition, "wait", original)
    monkeypatch.delenv(engine_plugin.ENV, raising=False)
    engine_plugin.register()
    assert SpinCondition.wait is original


def test_a_cpu_worker_hands_its_setting_to_vllms_processes() -> None:
    environ: dict[str, str] = {}
    worker_main.apply_busy_wait(settings.EngineSettings(), environ)
    assert environ == {engine_plugin.ENV: "0.002"}  # the default
    worker_main.apply_busy_wait(settings.EngineSettings(engine_busy_wait=0.5), environ)
    assert environ == {engine_plugin.ENV: "0.5"}


@pytest.mark.parametrize("seconds", [-1.0, float("nan")])
def test_a_negative_window_is_refused(seconds: float, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        worker_main.apply_busy_wait(settings.EngineSettings(engine_busy_wait=seconds), {})
    assert exit_info.value.code == settings.SETTINGS_ERROR_STATUS
    assert "--engine-busy-wait must be at least 0" in capsys.readouterr().err


def test_a_worker_says_when_vllm_is_told_to_leave_the_plugin_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        worker_main.apply_busy_wait(settings.EngineSettings(), {"VLLM_PLUGINS": "other"})
    assert "leaves out llmgate_busy_wait" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        environ = {"VLLM_PLUGINS": f"other,{engine_plugin.NAME}"}
        worker_main.apply_busy_wait(settings.EngineSettings(), environ)
    assert caplog.text == ""


def test_the_plugins_name_is_the_entry_points() -> None:
    from importlib.metadata import entry_points

    (entry,) = [
        e for e in entry_points(group="vllm.general_plugins") if e.name == engine_plugin.NAME
    ]
    assert entry.value == "worker.engine_plugin:register"
