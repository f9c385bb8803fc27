"""What a request may cost in tokens before it runs: the reservation its key's
token limit and budgets take (``gateway.tenants.limits``), settled to the
engine's count when it ends.

The token limit reserves the prompt as estimated (``Models.prompt_tokens``);
a budget reserves a bound instead (:func:`prompt_bound`), so that no request
can cost more than it reserved and concurrent requests cannot together pass
the budget: a byte-level tokenizer makes at most one token of every byte of
text, and a chat template is allowed ``TEMPLATE_TOKENS`` and
``MESSAGE_TOKENS`` a message of its own.
"""

from __future__ import annotations

from typing import Any

from gateway.dispatch.models import prompt_parts

# The fields that carry a prompt: chat, completions, the Responses API.
_PROMPT_FIELDS = ("messages", "prompt", "input")
# A chat template's own tokens, at most: its default system prompt and
# frame, and each message's role markers.
TEMPLATE_TOKENS = 64
MESSAGE_TOKENS = 8


def prompt_bound(raw: dict[str, Any]) -> int:
    """Tokens the prompt cannot exceed: a token a byte of its text, its token
    ids, and a chat template's allowance (images and audio are not bounded)."""
    texts, ids = prompt_parts(raw)
    messages = raw.get("messages")
    count = 0
    if isinstance(messages, list):
        nested = messages and all(isinstance(m, list) for m in messages)
        count = sum(len(m) for m in messages) if nested else len(messages)
    template = TEMPLATE_TOKENS + MESSAGE_TOKENS * count if count else 0
    return ids + sum(len(text.encode()) for text in texts) + template


def reserved(
    raw: dict[str, Any], prompt_tokens: int, context: int, choices: int
) -> tuple[int, int]:
    """Tokens a request may cost: its prompt, and per choice what it may generate
    (its ``max_tokens``, else the rest of the ``context``; 0 = not known). A body
    with no prompt at all (vLLM's ``/version``, ``/ping``) generates nothing."""
    asked = next(
        (
            raw[name]
            for name in ("max_tokens", "max_completion_tokens", "max_output_tokens")
            if isinstance(raw.get(name), int) and raw[name] > 0
        ),
        None,
    )
    room = max(context - prompt_tokens, 0) if context else None
    if asked is None:
        generated = (room or 0) if any(k in raw for k in _PROMPT_FIELDS) else 0
    else:
        generated = asked if room is None else min(asked, room)
    return prompt_tokens, generated * max(choices, 1)


def choices_of(raw: dict[str, Any]) -> int:
    """How many sequences a request may generate: ``n`` (or ``best_of``, when
    larger) for each of its prompts (a completions list of several, or the
    conversations of vLLM's ``/v1/chat/completions/batch``)."""
    width = max(
        (v for v in (raw.get("n"), raw.get("best_of")) if type(v) is int and v > 0), default=1
    )
    prompts = 1
    for name in ("prompt", "messages"):
        value = raw.get(name)
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            prompts = len(value) if name == "prompt" or isinstance(value[0], list) else 1
    return width * prompts
