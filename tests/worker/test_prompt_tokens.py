"""gateway/dispatch/tokens.py renders and tokenizes the embedded model's prompts as
Hugging Face's tokenizer does (``apply_chat_template``), from what a worker sends:
the tokenizer's JSON, the chat template and its special tokens."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.dispatch.tokens import PromptTokenizer
from shared import protocol
from shared.embedded import default_model_dir

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of Spain?"},
    ],
    [{"role": "user", "content": "Ünïcödé, emoji 🚀 and\nnew lines\t\ttabs."}],
]


@pytest.fixture(scope="module")
def reference() -> Any:
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture(scope="module")
def tokenizer(reference: Any) -> PromptTokenizer:
    """Built from what worker.engine.describe_tokenizer sends for this model."""
    special = {k: v for k, v in reference.special_tokens_map.items() if isinstance(v, str)}
    described = protocol.Tokenizer(
        model="m",
        tokenizer_json=reference.backend_tokenizer.to_str(),
        chat_template=reference.chat_template,
        special_tokens=special,
    )
    return PromptTokenizer(described)


@pytest.mark.parametrize("messages", CHATS)
def test_a_chat_renders_and_tokenizes_as_hugging_faces(
    tokenizer: PromptTokenizer, reference: Any, messages: list[dict[str, Any]]
) -> None:
    # As vLLM does it: the template rendered to text, then tokenized without
    # adding special tokens (the template holds them).
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.chat(messages) == reference(text, add_special_tokens=False)["input_ids"]


def test_text_parts_are_one_string(tokenizer: PromptTokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    assert tokenizer.chat(parts) == tokenizer.chat([{"role": "user", "content": "Hello"}])


def test_a_completions_prompt_tokenizes_as_hugging_faces(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    prompt = "Once upon a time, in a lighthouse,"
    assert tokenizer.completion(prompt) == reference(prompt)["input_ids"]


def test_a_chats_start_tokenizes_as_its_whole_and_kept_pieces_reach_further(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    # Routing reads a prompt unseen before only as far as a few fresh characters.
    document = " ".join(f"Paragraph {i} of a never-seen report." for i in range(300))
    messages = [
        {"role": "system", "content": document},
        {"role": "user", "content": "What does paragraph 7 say?"},
    ]
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    whole = reference(text, add_special_tokens=False)["input_ids"]
    start, cut = tokenizer.chat_ids(messages, fresh=500)
    assert cut and 100 < len(start) < len(whole)
    # All but the word the cut fell in are the whole's tokens.
    assert list(start[:-3]) == whole[: len(start) - 3]
    # Once the whole was read, its pieces are kept: a start reaches the end.
    assert tokenizer.chat(messages) == whole
    again, cut = tokenizer.chat_ids(messages, fresh=500)
    assert not cut and list(again) == whole
