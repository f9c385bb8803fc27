"""vLLM's IPC sockets in a directory of the worker's own (worker.rpc_dir)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from worker import main as worker_main
from worker import rpc_dir


def test_a_new_directory_unless_one_is_named() -> None:
    env: dict[str, str] = {}
    made = rpc_dir.make(env, "worker-0")
    assert made is not None and env[rpc_dir.ENV] == made
    assert Path(made).is_dir() and Path(made).name.startswith("llmgate-worker-0-")
    rpc_dir.remove(made)
    assert not Path(made).exists()
    # The user's own directory is theirs: neither replaced nor removed.
    assert rpc_dir.make(env, "worker-0") is None and env[rpc_dir.ENV] == made


def test_a_worker_started_alone_removes_its_directory_at_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Unset, and unset again after the test (main() sets it in this process).
    monkeypatch.setenv(rpc_dir.ENV, "")
    monkeypatch.delenv(rpc_dir.ENV)
    # A bad flag: the worker exits at once, as after any run.
    with pytest.raises(SystemExit):
        worker_main.main(["--no-such-flag"])
    made = Path(os.environ[rpc_dir.ENV])
    assert made.name.startswith("llmgate-worker-") and not made.exists()
