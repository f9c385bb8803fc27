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


# Answers that once differed from vLLM's server (found by running vLLM's own
# OpenAI-server tests against both), named after what each pins: a custom
# role reaches the chat template (the gateway said "Invalid enum value"); a
# seed beyond int64 is vLLM's pydantic error, whose constraint names
# (less_than_equal, greater_than_equal) clients match on.
_INT64_MAX = 2**63 - 1
_CUSTOM_ROLE = "my-custom-role"
_CMPL_SEEDED: dict[str, Any] = {"prompt": "The capital of France is", "max_tokens": 4}
_CHAT_SEEDED: dict[str, Any] = {"messages": FRANCE, "max_tokens": 4}
_PINNED: dict[str, dict[str, Any]] = {
    "chat-custom-role": {
        "messages": [{"role": _CUSTOM_ROLE, "content": "what is 1+1?"}],
        "max_tokens": 8,
    },
    "chat-custom-role-parts": {
        "messages": [{"role": _CUSTOM_ROLE, "content": [{"type": "text", "text": "what is 1+1?"}]}],
        "max_tokens": 8,
    },
    "chat-seed-above-int64": {**_CHAT_SEEDED, "seed": _INT64_MAX + 1},
    "chat-seed-below-int64": {**_CHAT_SEEDED, "seed": -_INT64_MAX - 2},
    "cmpl-seed-above-int64": {**_CMPL_SEEDED, "seed": _INT64_MAX + 1},
    "cmpl-seed-below-int64": {**_CMPL_SEEDED, "seed": -_INT64_MAX - 2},
}


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
    for name, body in _PINNED.items():
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        for stream in (False, True):
            full = {"model": MODEL, "temperature": 0, **body, "stream": stream}
            out.append((f"{name}-{'stream' if stream else 'whole'}", path, full))
    return out


# -- every field of vLLM 0.32's request types, one case each ------------------
#
# Each is a small greedy request that sets the field (with what it needs to
# matter); fields only vLLM's server answers go there through the worker
# (schemas.vllm_field), the others through the gateway's own builders. What
# vLLM refuses (a multimodal field on a text model, a chat template without
# --trust-request-chat-template, ...) must be refused alike: same status,
# same error JSON.

# Few tokens: each costs a step of both engines (about 60 ms on one core
# here). A field acts within them (the counting answer repeats "," at its
# second token, so the penalties do); those that need more set max_tokens.
_CMPL_BASE: dict[str, Any] = {"prompt": COUNTING, "max_tokens": 4}
_CHAT_BASE: dict[str, Any] = {"messages": FRANCE, "max_tokens": 6}
_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
_SHOWN_TOOLS = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
    },
    {"role": "user", "content": "What is the weather in Paris?"},
]

# Fields both request types have: (field, extra body fields).
_SHARED_FIELDS: dict[str, dict[str, Any]] = {
    "add_special_tokens": {"add_special_tokens": False},
    "allowed_token_ids": {"allowed_token_ids": [28, 29, 30, 31, 32, 33, 34]},
    "bad_words": {"bad_words": [" 4", "Paris"]},
    "cache_salt": {"cache_salt": "tenant-1"},
    "ec_transfer_params": {"ec_transfer_params": {}},
    "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 1.5},
    "ignore_eos": {"ignore_eos": True, "max_tokens": 12},
    "include_stop_str_in_output": {"stop": ["4"], "include_stop_str_in_output": True},
    "kv_transfer_params": {"kv_transfer_params": {}},
    "length_penalty": {"use_beam_search": True, "n": 2, "length_penalty": 0.5},
    "logit_bias": {"logit_bias": {"28": 5.0}},
    "logprob_token_ids": {"logprob_token_ids": [28, 29]},
    "logprobs": {},  # per type below
    "max_tokens": {"max_tokens": 3},
    "min_p": {"min_p": 0.2, "temperature": 0.8, "seed": 11},
    "min_tokens": {"min_tokens": 5, "stop": ["."], "max_tokens": 8},
    "mm_payload": {"mm_payload": "none"},
    "model": {},
    "n": {"n": 2},
    "presence_penalty": {"presence_penalty": 1.5},
    "priority": {"priority": 3},
    "prompt_logprobs": {"prompt_logprobs": 2},
    "repetition_detection": {
        "repetition_detection": {"max_pattern_size": 4, "min_pattern_size": 1, "min_count": 3},
        "max_tokens": 16,
    },
    "repetition_penalty": {"repetition_penalty": 1.3},
    "request_id": {"request_id": "parity-request"},
    "response_format": {"response_format": {"type": "json_object"}, "max_tokens": 10},
    "return_mm_kwargs": {"return_mm_kwargs": True},
    "return_token_ids": {"return_token_ids": True},
    "return_token_offsets": {"return_token_offsets": True, "logprobs": None},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "routed_experts_prompt_start": {"routed_experts_prompt_start": 1},
    "seed": {"seed": 1234, "temperature": 1.0},
    "session_id": {"session_id": "session-1"},
    "skip_special_tokens": {"skip_special_tokens": False, "ignore_eos": True, "max_tokens": 10},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "stop": {"stop": [","]},
    "stop_token_ids": {"stop_token_ids": [30]},
    "stream": {},
    "stream_interval": {"stream_interval": 2},
    "stream_options": {},  # per stream below: include_usage, continuous_usage_stats
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "temperature": {"temperature": 0.0},
    "thinking_token_budget": {"thinking_token_budget": 4},
    "top_k": {"top_k": 1, "temperature": 1.0},
    "top_p": {"top_p": 0.01, "temperature": 1.0},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 3},
    "truncation_side": {"truncate_prompt_tokens": 3, "truncation_side": "left"},
    "use_beam_search": {"use_beam_search": True, "n": 2},
    "user": {"user": "someone"},
    "vllm_xargs": {"vllm_xargs": {"note": "kept in extra_args"}},
    "watermarking": {"watermarking": True},
}
_COMPLETION_ONLY: dict[str, dict[str, Any]] = {
    "prompt": {"prompt": ["One, two,", "Red, green,"]},
    "prompt_embeds": {"prompt_embeds": "AAAA"},
    "suffix": {"suffix": " and so on."},
}
_CHAT_ONLY: dict[str, dict[str, Any]] = {
    "add_generation_prompt": {"add_generation_prompt": False},
    "chat_template": {"chat_template": "{{ messages[0]['content'] }}"},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "continue_final_message": {
        "messages": [*FRANCE, {"role": "assistant", "content": "The capital of France is"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    "documents": {"documents": [{"title": "Atlas", "text": "Paris is the capital of France."}]},
    "include_reasoning": {"include_reasoning": False},
    "max_completion_tokens": {"max_completion_tokens": 4},
    "media_io_kwargs": {"media_io_kwargs": {"image": {}}},
    "messages": {"messages": [{"role": "system", "content": "Be brief."}, *FRANCE]},
    "mm_processor_kwargs": {"mm_processor_kwargs": {}},
    "parallel_tool_calls": {
        "tools": [_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 40,
    },
    "reasoning_effort": {"reasoning_effort": "low"},
    "return_prompt_text": {"return_prompt_text": True},
    "tool_choice": {
        "tools": [_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 40,
    },
    "tools": {"messages": _SHOWN_TOOLS, "tools": [_TOOL], "tool_choice": "auto", "max_tokens": 40},
    "top_logprobs": {"logprobs": True, "top_logprobs": 3},
}
_PER_KIND = {
    "completion": {"logprobs": {"logprobs": 2}},
    "chat": {"logprobs": {"logprobs": True}},
}


# Fields that only steer what the engine samples, or which prompt it gets:
# they reach vLLM's sampling parameters and prompt the same way whether the
# answer is streamed or not, and change nothing in how a stream's chunks are
# made. Each is sent whole only; the stream path is the other cases' (every
# field that shapes an answer's events: logprobs, echo, n, stop strings, token
# ids, detokenizing, tools, reasoning, limits and finish reasons, the stream
# options) and each of those is sent both ways.
_WHOLE_ONLY = {
    *("add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt"),
    *("ec_transfer_params", "frequency_penalty", "kv_transfer_params", "logit_bias"),
    *("min_p", "mm_payload", "model", "presence_penalty", "priority", "repetition_penalty"),
    *("request_id", "routed_experts_prompt_start", "seed", "session_id", "temperature"),
    *("top_k", "top_p", "truncate_prompt_tokens", "truncation_side", "user", "vllm_xargs"),
    *("watermarking", "return_mm_kwargs", "prompt_embeds"),
    # guided decoding masks what is sampled; a beam's length penalty ranks
    # beams (use_beam_search is streamed)
    *("response_format", "structured_outputs", "length_penalty"),
    # chat: the prompt the template makes
    *("chat_template", "chat_template_kwargs", "documents", "media_io_kwargs"),
    *("mm_processor_kwargs", "messages", "add_generation_prompt"),
}


def field_cases() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, body) per field of each request type: whole, and streamed
    unless the field only steers sampling or the prompt (``_WHOLE_ONLY``)."""
    out = []
    for kind, path, base, own in (
        ("completion", "/v1/completions", _CMPL_BASE, _COMPLETION_ONLY),
        ("chat", "/v1/chat/completions", _CHAT_BASE, _CHAT_ONLY),
    ):
        fields = {**_SHARED_FIELDS, **_PER_KIND[kind], **own}
        for field, extra in fields.items():
            for stream in (False,) if field in _WHOLE_ONLY else (False, True):
                body: dict[str, Any] = {"model": MODEL, "temperature": 0, **base, **extra}
                body = {k: v for k, v in body.items() if v is not None}
                body["stream"] = stream
                if stream:
                    body["stream_options"] = {
                        "include_usage": True,
                        "continuous_usage_stats": field == "stream_options",
                    }
                out.append((f"{kind}-{field}-{'stream' if stream else 'whole'}", path, body))
    return out


def covered_fields(kind: str) -> set[str]:
    own = _COMPLETION_ONLY if kind == "completion" else _CHAT_ONLY
    return set(_SHARED_FIELDS) | set(_PER_KIND[kind]) | set(own)


# -- vLLM's other routes: (name, method, path, body) ----------------------------

ROUTE_CASES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    ("tokenize-prompt", "POST", "/tokenize", {"model": MODEL, "prompt": "Hello world"}),
    (
        "tokenize-chat",
        "POST",
        "/tokenize",
        {"model": MODEL, "messages": FRANCE, "return_token_strs": True},
    ),
    ("detokenize", "POST", "/detokenize", {"model": MODEL, "tokens": [19556, 905]}),
    ("version", "GET", "/version", None),
    ("ping-get", "GET", "/ping", None),
    ("ping-post", "POST", "/ping", None),
    (
        "invocations-chat",
        "POST",
        "/invocations",
        {"model": MODEL, "messages": FRANCE, "max_tokens": 8, "temperature": 0},
    ),
    (
        "invocations-completion",
        "POST",
        "/invocations",
        {"model": MODEL, "prompt": COUNTING, "max_tokens": 6, "temperature": 0},
    ),
    (
        "chat-batch",
        "POST",
        "/v1/chat/completions/batch",
        {
            "model": MODEL,
            "messages": [FRANCE, [{"role": "user", "content": "Say hi."}]],
            "max_tokens": 6,
            "temperature": 0,
        },
    ),
    (
        "responses-whole",
        "POST",
        "/v1/responses",
        {
            "model": MODEL,
            "input": "What is the capital of France?",
            "max_output_tokens": 12,
            "temperature": 0,
        },
    ),
    (
        "responses-stream",
        "POST",
        "/v1/responses",
        {
            "model": MODEL,
            "input": "What is the capital of France?",
            "max_output_tokens": 12,
            "temperature": 0,
            "stream": True,
        },
    ),
    (
        "responses-instructions",
        "POST",
        "/v1/responses",
        {
            "model": MODEL,
            "instructions": "Answer in one word.",
            "input": [{"role": "user", "content": "Capital of France?"}],
            "max_output_tokens": 8,
            "temperature": 0,
        },
    ),
    ("responses-get-unknown", "GET", "/v1/responses/resp_parity_missing", None),
    (
        "messages",
        "POST",
        "/v1/messages",
        {"model": MODEL, "messages": FRANCE, "max_tokens": 8, "temperature": 0},
    ),
]
