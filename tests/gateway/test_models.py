"""gateway/dispatch/models.py: names, aliases, substitutes and auto rules resolve to pools."""

from __future__ import annotations

from typing import Any

from gateway.dispatch.models import Models, Tier, prompt_parts
from shared import config

CONFIG = """\
pools:
  - {name: small, served_model_name: cheap, spill_after: 0.5}
  - {name: gpu-big, served_model_name: big}
  - {name: cpu-big, served_model_name: big, tier: 2}
  - {name: spare, served_model_name: spare, tier: 2, substitute_for: [cheap]}
aliases:
  fast: cheap
auto:
  rules:
    - {name: by-header, headers: {X-LLMGate-Tier: expensive}, use: big}
    - {name: long, prompt_tokens_over: 10, use: big}
    - {name: long-answer, max_tokens_over: 200, use: big}
    - {name: json, has_response_format: true, use: big}
    - {name: tools, has_tools: true, use: big}
  default: fast
  cascade: {escalate_to: big, min_mean_logprob: -0.7}
"""


def models() -> Models:
    # Four characters a token: the estimate, so the test needs no tokenizer.
    return Models(config.parse(CONFIG), count_tokens=lambda text: -(-len(text) // 4))


def route(body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None) -> str:
    return models().resolve("auto", body, headers or []).rule


def test_a_served_name_runs_on_its_pools_in_tier_order_then_its_substitutes() -> None:
    table = models()
    assert table.resolve("big", {}, []).tiers == (
        Tier("gpu-big", "big", 1, None),
        Tier("cpu-big", "big", 2, None),
    )
    cheap = table.resolve("cheap", {}, [])
    assert cheap.tiers == (Tier("small", "cheap", 1, 0.5), Tier("spare", "spare", 2, None))


def test_an_alias_is_its_target() -> None:
    table = models()
    assert table.resolve("fast", {}, []) == table.resolve("cheap", {}, [])


def test_an_undeclared_name_goes_to_whichever_workers_serve_it() -> None:
    target = models().resolve("some-lora", {}, [])
    assert target.tiers == (Tier("", "some-lora"),)
    assert Models().resolve("m", {}, []).tiers == (Tier("", "m"),)  # no config


def test_only_the_configs_names_are_declared() -> None:
    """A declared name no worker serves yet is a 503 (starting), an undeclared one a 404."""
    table = models()
    for name in ("cheap", "big", "fast", "auto"):
        assert table.resolve(name, {}, []).declared, name
    assert not table.resolve("some-lora", {}, []).declared
    assert not Models().resolve("m", {}, []).declared  # no config: nothing is


def test_auto_rules_match_in_order_first_match_wins() -> None:
    assert route({"prompt": "hi"}, [(b"x-llmgate-tier", b"expensive")]) == "by-header"
    assert route({"prompt": "hi"}, [(b"x-llmgate-tier", b"cheap")]) == "default"
    assert route({"prompt": "x" * 41}) == "long"  # 11 tokens > 10
    assert route({"prompt": "x" * 40}) == "default"  # 10 tokens, not over
    assert route({"messages": [{"role": "user", "content": "y" * 41}]}) == "long"
    assert route({"prompt": [1, 2, 3] * 4}) == "long"  # token ids count as given
    assert route({"prompt": "hi", "max_tokens": 201}) == "long-answer"
    assert route({"messages": [], "max_completion_tokens": 300}) == "long-answer"
    assert route({"prompt": "hi", "response_format": {"type": "json_object"}}) == "json"
    assert route({"messages": [], "tools": [{"type": "function"}]}) == "tools"
    assert route({"messages": [], "tools": []}) == "default"


def test_the_default_route_cascades_only_when_not_streaming() -> None:
    table = models()
    target = table.resolve("auto", {"prompt": "hi"}, [])
    assert target.model == "cheap" and target.rule == "default"
    assert target.escalate_to is not None and target.escalate_to.model == "big"
    assert target.min_mean_logprob == -0.7
    assert table.resolve("auto", {"prompt": "hi", "stream": True}, []).escalate_to is None
    # A rule's choice does not cascade.
    assert table.resolve("auto", {"prompt": "hi", "max_tokens": 999}, []).escalate_to is None


def test_the_model_list_shows_aliases_and_auto() -> None:
    assert models().listing(["cheap", "big"]) == [
        {"id": "fast", "alias_for": "cheap"},
        {"id": "auto", "routes_to": ["big", "fast"]},
    ]


def test_the_prompt_estimate_counts_every_dialects_prompt_fields() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    texts, ids = prompt_parts(
        {
            "instructions": "be brief",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "system": [{"type": "text", "text": "you are a bot"}],
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
            ],
            "tools": [tool],
        }
    )
    assert ids == 0
    for text in ("q", "{}", "hi", "be brief", "you are a bot", '"name":"f"'):
        assert any(text in t for t in texts), text
    assert models().prompt_tokens({"input": "x" * 40, "instructions": "y" * 40}) >= 20
