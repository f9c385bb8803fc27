"""Model names: which pools a request's ``model`` may run on, in tier order.

:meth:`Models.resolve` turns a served model name, an alias or the ``auto`` name
(``shared.config``) into a :class:`Target`: the served model and the pools that
may run it, first those that serve it (by tier), then its declared substitutes.
``auto`` takes the first of the config's rules that matches, else its default,
which may carry a cascade (``gateway.dispatch.cascade``). Without a config every
name is its own target, served by whichever workers say they serve it. Which
tier runs the request, and the answer when no worker serves its target now (a 503
for a name the config declares, :attr:`Target.declared`, or a worker once served;
else a 404), are ``gateway.dispatch.admission``'s.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway import metrics
from gateway.dispatch.discovery import normalize_address
from shared import config as pools_config

log = logging.getLogger(__name__)

# Characters per token when no tokenizer is at hand (English text, roughly).
CHARS_PER_TOKEN = 4
# Targets of undeclared model names remembered between requests.
UNDECLARED_KEPT = 256


@dataclass(frozen=True, slots=True)
class Tier:
    """One pool a target may run on."""

    # The pool's name; "" = any worker serving ``model`` (no config).
    pool: str
    # The served model name its workers know the request by.
    model: str
    tier: int = 1
    # Seconds a request waits for this pool before it may spill to the next
    # tiers (None: never).
    spill_after: float | None = None

    @property
    def label(self) -> str:
        """The pool's name in metrics (the model's when there is no config)."""
        return self.pool or self.model


@dataclass(frozen=True, slots=True)
class Target:
    """Where one request may run: its served model's pools, home tier first."""

    model: str
    tiers: tuple[Tier, ...]
    # The auto rule that chose it ("default" when none matched), or "".
    rule: str = ""
    # Auto's default route with a cascade: where to escalate, and the bar.
    escalate_to: Target | None = None
    min_mean_logprob: float = 0.0

    @property
    def declared(self) -> bool:
        """Whether the config declares it: its tiers name their pools, where an
        undeclared name's one tier is "any worker serving it" (pool "")."""
        return any(tier.pool for tier in self.tiers)


@dataclass
class Models:
    config: pools_config.Config | None = None
    # Counts a prompt's tokens for `prompt_tokens_over` (None: estimate).
    count_tokens: Any = None
    _targets: dict[str, Target] = field(default_factory=dict)
    _undeclared: dict[str, Target] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.config is None:
            return
        for name in self.config.served_models():
            self._targets[name] = self._served(name)
        for alias, served in self.config.aliases.items():
            self._targets[alias] = self._targets[served]
        auto = self.config.auto
        if auto is not None and any(r.prompt_tokens_over is not None for r in auto.rules):
            self.count_tokens = self.count_tokens or load_token_counter(auto.tokenizer)

    @classmethod
    def from_file(cls, path: str) -> Models:
        return cls(pools_config.load(path)) if path else cls()

    # -- names ---------------------------------------------------------------

    @property
    def auto_name(self) -> str | None:
        auto = self.config.auto if self.config else None
        return auto.name if auto else None

    def pool_of_address(self) -> dict[str, str]:
        """``tcp://`` address -> pool, for workers the config places (llmgate gateway)."""
        if self.config is None:
            return {}
        return {
            normalize_address(a): pool.name for pool in self.config.pools for a in pool.addresses
        }

    def addresses(self) -> list[str]:
        return list(self.pool_of_address())

    # -- resolution ------------------------------------------------------------

    def resolve(
        self, model: str, raw: dict[str, Any], headers: Iterable[tuple[bytes, bytes]]
    ) -> Target:
        """The target of a request for ``model`` (its body ``raw``, its ASGI headers)."""
        target = self._targets.get(model) or self._undeclared.get(model)
        if target is not None:
            return target
        if model == self.auto_name:
            return self._auto(raw, headers)
        # Not declared: whichever workers serve it (LoRA adapters, or no config).
        # Kept for the next request, a bounded number of them (clients choose names).
        target = Target(model, (Tier("", model),))
        if len(self._undeclared) >= UNDECLARED_KEPT:
            self._undeclared.clear()
        self._undeclared[model] = target
        return target

    def _served(self, name: str) -> Target:
        assert self.config is not None
        pools = self.config.pools
        serving = sorted((p for p in pools if p.model_name == name), key=lambda p: p.tier)
        home_tier = serving[0].tier
        substitutes = sorted(
            (p for p in pools if name in p.substitute_for and p.tier >= home_tier),
            key=lambda p: p.tier,
        )
        tiers = tuple(
            Tier(p.name, p.model_name, p.tier, p.spill_after) for p in serving + substitutes
        )
        return Target(name, tiers)

    def _auto(self, raw: dict[str, Any], headers: Iterable[tuple[bytes, bytes]]) -> Target:
        assert self.config is not None and self.config.auto is not None
        auto = self.config.auto
        wanted = (
            {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
            if any(rule.headers for rule in auto.rules)
            else {}
        )
        for index, rule in enumerate(auto.rules):
            name = rule.name or f"rule-{index + 1}"
            if self._matches(rule, raw, wanted):
                return self._chosen(rule.use, name)
        chosen = self._chosen(auto.default, "default")
        cascade = auto.cascade
        if cascade is None or raw.get("stream"):
            return chosen
        escalate = self._targets[cascade.escalate_to]
        return Target(
            chosen.model,
            chosen.tiers,
            rule="default",
            escalate_to=escalate,
            min_mean_logprob=cascade.min_mean_logprob,
        )

    def _chosen(self, use: str, rule: str) -> Target:
        target = self._targets[use]
        metrics.child(metrics.AUTO_ROUTES, rule, target.tiers[0].label).inc()
        log.debug("auto: rule %s chose %s (pool %s)", rule, target.model, target.tiers[0].label)
        return Target(target.model, target.tiers, rule=rule)

    def _matches(
        self, rule: pools_config.Rule, raw: dict[str, Any], headers: dict[str, str]
    ) -> bool:
        if rule.has_response_format is not None:
            if (raw.get("response_format") is not None) != rule.has_response_format:
                return False
        if rule.has_tools is not None:
            if bool(raw.get("tools")) != rule.has_tools:
                return False
        for name, value in rule.headers.items():
            if headers.get(name.lower()) != value:
                return False
        if rule.max_tokens_over is not None:
            # TGI's routes arrive here as the completions body they run
            # (gateway.dialects.tgi.to_completion): max_new_tokens is max_tokens by now.
            asked = raw.get("max_tokens") or raw.get("max_completion_tokens")
            if not isinstance(asked, int) or asked <= rule.max_tokens_over:
                return False
        if rule.prompt_tokens_over is not None:
            if self.prompt_tokens(raw) <= rule.prompt_tokens_over:
                return False
        return True

    def price(self, target: Target) -> pools_config.Price | None:
        """The price a request for ``target`` is counted at: the dearest of the
        pools it may run on (spill-over, a cascade's escalation), so no route
        costs less than it may; None when any of them has no price."""
        if self.config is None:
            return None
        by_pool = {pool.name: pool.price for pool in self.config.pools}
        names = [tier.pool for tier in target.tiers]
        if target.escalate_to is not None:
            names += [tier.pool for tier in target.escalate_to.tiers]
        prices = [by_pool.get(name) for name in names]
        if not prices or any(price is None for price in prices):
            return None
        known = [price for price in prices if price is not None]
        return pools_config.Price(
            input=max(p.input for p in known), output=max(p.output for p in known)
        )

    def prompt_tokens(self, raw: dict[str, Any]) -> int:
        """The prompt's length in tokens, whatever the dialect (:func:`prompt_parts`);
        token-id prompts count as given, text (without a chat template's own
        tokens) by the tokenizer of the ``auto`` rules or at
        ``CHARS_PER_TOKEN`` characters a token."""
        texts, ids = prompt_parts(raw)
        text = "\n".join(texts)
        if self.count_tokens is not None:
            return ids + int(self.count_tokens(text))
        return ids + -(-len(text) // CHARS_PER_TOKEN)

    # -- /v1/models ------------------------------------------------------------

    def listing(self, served: list[str]) -> list[dict[str, Any]]:
        """Extra entries of ``/v1/models`` beside the ``served`` models: aliases
        (``alias_for``) and the auto name (``routes_to``)."""
        out: list[dict[str, Any]] = []
        aliases = self.config.aliases if self.config else {}
        for alias, target in aliases.items():
            out.append({"id": alias, "alias_for": target})
        auto = self.config.auto if self.config else None
        if auto is not None:
            uses = [r.use for r in auto.rules] + [auto.default]
            if auto.cascade is not None:
                uses.append(auto.cascade.escalate_to)
            out.append({"id": auto.name, "routes_to": list(dict.fromkeys(uses))})
        return out


def load_token_counter(tokenizer: str) -> Any:
    """A function text -> token count, from ``tokenizer`` (a model directory or a
    tokenizer.json) or the embedded model's; None (estimate) if there is none."""
    path = Path(tokenizer) if tokenizer else _embedded_tokenizer()
    if path is not None and path.is_dir():
        path = path / "tokenizer.json"
    if path is None or not path.is_file():
        if tokenizer:
            raise pools_config.ConfigError(f"auto.tokenizer: no tokenizer.json at {tokenizer}")
        log.warning(
            "auto: no tokenizer for prompt_tokens_over; estimating %d characters a token",
            CHARS_PER_TOKEN,
        )
        return None
    from tokenizers import Tokenizer

    loaded = Tokenizer.from_file(str(path))
    log.info("auto: counting prompt tokens with %s", path)
    return lambda text: len(loaded.encode(text, add_special_tokens=False).ids)


def _embedded_tokenizer() -> Path | None:
    from shared.embedded import default_model_dir

    directory = default_model_dir()
    return directory if directory.is_dir() else None


def prompt_parts(raw: dict[str, Any]) -> tuple[list[str], int]:
    """The texts a request puts before the model, and how many token ids: a
    completion's ``prompt``, a chat's ``messages`` (tool calls' arguments
    too), the Responses API's ``input`` and ``instructions``, Anthropic's
    ``system``, and every dialect's ``tools`` (their schemas go in the prompt)."""
    texts: list[str] = []
    ids = 0
    prompt = raw.get("prompt")
    if isinstance(prompt, str):
        texts.append(prompt)
    elif isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, int):
                ids += 1
            elif isinstance(item, list):
                ids += len(item)
    for name in ("messages", "input", "instructions", "system"):
        _texts_of(raw.get(name), texts)
    tools = raw.get("tools")
    if tools:
        texts.append(json.dumps(tools, separators=(",", ":")))
    return texts, ids


def _texts_of(value: Any, texts: list[str]) -> None:
    """The text in a message, a content part or a list of them (any dialect's)."""
    if isinstance(value, str):
        texts.append(value)
    elif isinstance(value, list):
        for item in value:
            _texts_of(item, texts)
    elif isinstance(value, dict):
        for name in ("content", "text", "input", "output"):
            _texts_of(value.get(name), texts)
        calls = value.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    _texts_of(function.get("arguments"), texts)
