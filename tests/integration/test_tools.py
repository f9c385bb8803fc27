"""Tool calls through the OpenAI SDK, with the real engine and vLLM's own parser.

The session worker runs with ``--enable-auto-tool-choice --tool-call-parser
hermes`` (tests.conftest.TOOL_FLAGS). Named and required calls are decoded
under the function's JSON schema (llmgate's workers default to vLLM's
``--tool-strict-level parameter``: under vLLM's own default the embedded
model answers the JSON string ``"Paris"`` for ``{"city": ...}``); ``auto``
is the model's choice, which it makes in the Hermes format once shown it.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from tests.conftest import MODEL, Served

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string"}},
    "required": ["timezone"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a timezone",
            "parameters": TIME,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# The Hermes format, shown twice: the model then writes it on its own (auto).
SHOWN = [
    {
        "role": "system",
        "content": "You call tools. To call a tool, answer only with "
        '<tool_call>{"name": "get_weather", "arguments": {"city": "CITY"}}</tool_call>',
    },
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
    },
    *QUESTION,
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(served: Served) -> OpenAI:
    return OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)


def assert_valid_calls(calls: list[Any], names: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.id and call.type == "function"
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])


def streamed_calls(client: OpenAI, **kwargs: Any) -> tuple[list[dict[str, Any]], str | None]:
    """The tool calls a stream built up from its deltas (by index), and its finish reason."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or delta.id
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def forced(tool_choice: Any) -> dict[str, Any]:
    """The question, with the tools, a forced tool choice, greedy."""
    return {
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 80,
        "temperature": 0,
    }


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_have_arguments_valid_under_the_schema(
    client: OpenAI, tool_choice: Any
) -> None:
    choice = client.chat.completions.create(model=MODEL, **forced(tool_choice)).choices[0]
    names = {"get_weather"} if tool_choice == NAMED else set(SCHEMAS)
    assert_valid_calls(choice.message.tool_calls or [], names)
    # As vLLM (and OpenAI) answer them: a named call ends with "stop".
    assert choice.finish_reason == ("stop" if tool_choice == NAMED else "tool_calls")


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_stream_as_indexed_deltas(client: OpenAI, tool_choice: Any) -> None:
    calls, _ = streamed_calls(client, **forced(tool_choice))
    assert calls and all(c["id"] and c["name"] in SCHEMAS for c in calls), calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    # The same calls as the whole response's.
    whole = client.chat.completions.create(model=MODEL, **forced(tool_choice))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (t.function.name, json.loads(t.function.arguments))
        for t in whole.choices[0].message.tool_calls or []
    ]


def test_auto_parses_the_calls_the_model_writes(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=SHOWN, tools=TOOLS, tool_choice="auto", max_tokens=80, temperature=0
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert_valid_calls(choice.message.tool_calls or [], set(SCHEMAS))
    # The parser took the markup out of the text.
    assert "<tool_call>" not in (choice.message.content or "")

    calls, finish = streamed_calls(
        client, messages=SHOWN, tools=TOOLS, tool_choice="auto", max_tokens=80, temperature=0
    )
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls or []
    ]


def test_none_answers_in_text(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=SHOWN, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    choice = response.choices[0]
    assert not choice.message.tool_calls
    assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_a_conversation_sends_the_tool_result_back(client: OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, max_tokens=80, temperature=0
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history: list[Any] = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature_c": 18, "sky": "clear"}),
        },
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0
    )
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content and not choice.message.tool_calls
