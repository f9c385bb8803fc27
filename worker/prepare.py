"""A request in, what the engine runs out: rendered prompts, ``SamplingParams``, within limits.

The job vLLM's ``InputProcessor`` does for its engine, done with vLLM's own
parts so a request means the same here as under ``vllm serve``: span
extraction rewrites the body's schema (``worker.json_spans``), vLLM's pydantic
request types parse it and map it onto ``SamplingParams``
(``worker.sampling``), and the ``OnlineRenderer`` of vLLM's own app
(``worker.vllm_app``) applies the chat template and tokenizes. What this
module adds is this server's token limits (``--max-input-tokens``,
``--max-total-tokens``) and what the output side needs to know of each
prompt (its length, the text ``echo`` repeats, prompted keys).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from shared import protocol
from worker import json_spans, sampling
from worker.errors import RequestError, from_error_response

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """TGI-style serving limits, in tokens; 0 means no limit beyond the model's."""

    max_input_tokens: int = 0
    max_total_tokens: int = 0


@dataclass
class PreparedPrompt:
    engine_input: Any
    sampling_params: Any
    prompt_tokens: int
    # The prompt's text, when the response must echo it (completions' ``echo``).
    echo_text: str | None = None
    # Prompted key -> plain key, when the schema prompts inside keys (worker.json_spans).
    key_prompts: dict[str, str] | None = None
    # Tokens of the answer generated before, on a worker that failed: the
    # prompt's last ``carried`` tokens (``Generate.continuation``).
    carried: int = 0
    # With stop strings, a continued answer's text around the seam: the end
    # of what was sent, and what was held back (``worker.seam_stops``).
    seam_text: tuple[str, str] | None = None


class Preparer:
    """Turns one request's body into the prompts the engine runs."""

    def __init__(
        self,
        model_config: Any,
        renderer: Any,
        tokenizer: Any,
        limits: Limits,
        default_sampling_params: dict[str, Any],
    ) -> None:
        self.model_config = model_config
        # vLLM's app's renderer, so a chat renders alike on both paths
        # (--chat-template, its content format, ...).
        self.renderer = renderer
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_model_len: int = model_config.max_model_len
        # The model's generation_config.json defaults, as vllm serve applies them.
        self.default_sampling_params = default_sampling_params

    async def prepare(
        self,
        kind: protocol.RequestKind,
        params: dict[str, Any],
        continuation: protocol.Continuation | None = None,
    ) -> list[PreparedPrompt]:
        """Validate, render and tokenize one request: one entry per prompt; with a
        ``continuation``, its one prompt goes on from those tokens."""
        applied = json_spans.apply(kind, params)
        if applied.grammar_rules:
            log.info(
                "span grammar: %d rules, built in %.1f ms",
                applied.grammar_rules,
                applied.build_seconds * 1000,
            )
        request = sampling.parse_request(kind, applied.params)
        engine_inputs = await self.render(kind, request)
        prepared = []
        for engine_input in engine_inputs:
            prompt_tokens = sampling.prompt_length(self.model_config, engine_input)
            context = self.check_limits(kind, request, prompt_tokens)
            sampling_params = sampling.to_sampling_params(
                request, prompt_tokens, context, self.default_sampling_params
            )
            echo_text = None
            if kind == "completion" and request.echo:
                echo_text = self._prompt_text(engine_input)
            prepared.append(
                PreparedPrompt(
                    engine_input,
                    sampling_params,
                    prompt_tokens,
                    echo_text,
                    applied.key_prompts or None,
                )
            )
        if continuation:
            from worker.continuation import continued

            return continued(prepared, continuation, self.model_config, self.tokenizer)
        return prepared

    async def render(self, kind: protocol.RequestKind, request: Any) -> list[Any]:
        """The engine inputs of a parsed request: the chat template applied, tokenized."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if kind == "chat":
            rendered = await self.renderer.render_chat(request)
            if isinstance(rendered, ErrorResponse):
                raise from_error_response(rendered)
            _conversation, engine_inputs = rendered
            return list(engine_inputs)
        rendered_cmpl = await self.renderer.render_completion(request)
        if isinstance(rendered_cmpl, ErrorResponse):
            raise from_error_response(rendered_cmpl)
        return list(rendered_cmpl)

    async def prompt_lengths(self, kind: protocol.RequestKind, request: Any) -> list[int]:
        """The tokens of each prompt of a parsed request, as the engine will count them."""
        return [
            sampling.prompt_length(self.model_config, engine_input)
            for engine_input in await self.render(kind, request)
        ]

    def check_limits(self, kind: protocol.RequestKind, request: Any, prompt_tokens: int) -> int:
        """Refuse a prompt over the limits (400 naming the limit); the context left to use."""
        limits = self.limits
        param = "messages" if kind == "chat" else "prompt"
        if limits.max_input_tokens and prompt_tokens > limits.max_input_tokens:
            raise RequestError(
                400,
                f"The prompt has {prompt_tokens} tokens, more than this server's "
                f"--max-input-tokens of {limits.max_input_tokens}.",
                param,
            )
        if not limits.max_total_tokens:
            return self.max_model_len
        requested = sampling.requested_max_tokens(request)
        if requested is not None and prompt_tokens + requested > limits.max_total_tokens:
            raise RequestError(
                400,
                f"The prompt ({prompt_tokens} tokens) plus max_tokens ({requested}) is "
                f"{prompt_tokens + requested} tokens, more than this server's "
                f"--max-total-tokens of {limits.max_total_tokens}.",
                "max_tokens",
            )
        return min(self.max_model_len, limits.max_total_tokens)

    def _prompt_text(self, engine_input: Any) -> str:
        text = engine_input.get("prompt") if isinstance(engine_input, dict) else None
        if text is None:
            token_ids = sampling.prompt_token_ids(self.model_config, engine_input)
            text = self.tokenizer.decode(token_ids)
        return str(text)
