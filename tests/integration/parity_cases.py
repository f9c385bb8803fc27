"""The requests the parity test sends to both servers (greedy, small outputs)."""

from __future__ import annotations

from typing import Any

MODEL = "smollm2-135m-instruct"

COUNTING = "Count with me: 1, 2, 3,"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]

_COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "The capital of France is", "max_tokens": 8},
    {"prompt": ["One, two,", "Red, green,"], "max_tokens": 6},
    {"prompt": [504, 3458, 282, 4649, 314], "max_tokens": 5},
    {"prompt": COUNTING, "max_tokens": 20, "stop": [" 6"]},
    {"prompt": COUNTING, "max_tokens": 20, "stop": [" 6"], "include_stop_str_in_output": True},
    {"prompt": COUNTING, "max_tokens": 6, "logprobs": 2},
    {"prompt": "Hello", "max_tokens": 5, "echo": True},
    {"prompt": "The capital of France is", "max_tokens": 3, "echo": True, "logprobs": 1},
]

_CHATS: list[dict[str, Any]] = [
    {"messages": FRANCE, "max_tokens": 12},
    {
        "messages": [{"role": "system", "content": "Answer in one word."}, *FRANCE],
        "max_completion_tokens": 10,
    },
    {"messages": FRANCE, "max_tokens": 5, "logprobs": True, "top_logprobs": 2},
    {"messages": FRANCE, "max_tokens": 30, "stop": ["."]},
    {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
        "max_tokens": 8,
    },
]


def cases() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, body) for every request, each once whole and once streamed."""
    out = []
    for path, bodies in (("/v1/completions", _COMPLETIONS), ("/v1/chat/completions", _CHATS)):
        for i, body in enumerate(bodies):
            for stream in (False, True):
                full = {"model": MODEL, "temperature": 0, **body, "stream": stream}
                if stream and i % 2 == 0:
                    full["stream_options"] = {"include_usage": True}
                kind = "chat" if "messages" in body else "cmpl"
                out.append((f"{kind}{i}-{'stream' if stream else 'whole'}", path, full))
    return out
