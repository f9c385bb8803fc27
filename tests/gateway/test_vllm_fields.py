"""Which chat and completion requests the gateway sends to vLLM's own server
in the worker (kind "vllm"), and which it answers with its own builders."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.api.openai_routes import _reasoning
from gateway.dialects import schemas


@pytest.mark.parametrize(
    ("kind", "body", "field"),
    [
        ("chat", {"model": "m", "messages": [], "temperature": 0, "logprobs": True}, None),
        ("chat", {"model": "m", "messages": [], "tools": [{"type": "function"}]}, "tools"),
        ("chat", {"model": "m", "messages": [], "tools": None}, None),  # null is absent
        (
            "chat",
            {"model": "m", "messages": [], "continue_final_message": True},
            "continue_final_message",
        ),
        ("completion", {"model": "m", "prompt": "x", "echo": True, "logprobs": 1}, None),
        ("completion", {"model": "m", "prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
        ("completion", {"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        (
            "completion",
            {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}},
            None,
        ),
        (
            "completion",
            {
                "model": "m",
                "prompt": "x",
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            None,
        ),
        (
            "chat",
            {"model": "m", "messages": [], "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ("chat", {"model": "m", "messages": [], "unknown_extension": 1}, "unknown_extension"),
    ],
)
def test_the_first_field_only_vllm_answers(
    kind: Any, body: dict[str, Any], field: str | None
) -> None:
    assert schemas.vllm_field(kind, body) == field


def worker(models: set[str], reasoning: bool) -> SimpleNamespace:
    return SimpleNamespace(models=frozenset(models), reasoning_parser=reasoning)


def pool(*workers: SimpleNamespace) -> Any:
    return SimpleNamespace(healthy_workers=lambda: list(workers))


def test_chats_go_to_vllm_where_a_worker_of_the_model_has_a_reasoning_parser() -> None:
    mixed = pool(worker({"plain"}, False), worker({"thinker"}, True))
    assert _reasoning(mixed, "thinker")
    assert not _reasoning(mixed, "plain")
    # A name no worker serves as such (an alias, auto): any worker may run it.
    assert _reasoning(mixed, "alias")
    assert not _reasoning(pool(worker({"plain"}, False)), "alias")
