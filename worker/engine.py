"""The worker's model: vLLM's ``AsyncLLM`` plus vLLM's own OpenAI request handling.

We reuse vLLM's pieces rather than re-implement them, so a request means the
same here as under ``vllm serve``:

* ``AsyncEngineArgs`` parses every vLLM flag;
* vLLM's pydantic ``CompletionRequest`` / ``ChatCompletionRequest`` validate
  the body and map it onto ``SamplingParams`` (``worker.sampling``);
* the ``OnlineRenderer`` of vLLM's own app applies the chat template and
  tokenizes (``worker.vllm_app``, which also answers what text deltas cannot
  carry: tool calls, the Responses API, ``/tokenize``, ...).

What this module adds is the shape the wire needs: a request's outputs become
:class:`shared.protocol.Delta` items, one per choice per engine step.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from shared import protocol
from worker import sampling, spans
from worker.key_prompts import KeyRewriter
from worker.sampling import RequestError
from worker.vllm_app import VllmApp

log = logging.getLogger(__name__)


def add_engine_args(parser: Any) -> None:
    """Every vLLM engine flag (``--model``, ``--dtype``, ``--max-model-len``, ...),
    and ``vllm serve``'s request-handling flags (``--lora-modules``,
    ``--tool-call-parser``, ``--chat-template``, ...; ``worker.vllm_app``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from worker.vllm_app import add_frontend_args

    AsyncEngineArgs.add_cli_args(parser)
    add_frontend_args(parser)


class LoadTracker:
    """Keeps the scheduler's latest figures (waiting requests, KV-cache use).

    Registered as a vLLM stat logger, so it is fed on every engine step with
    the same numbers vLLM's own ``/metrics`` report.
    """

    def __init__(self) -> None:
        self.waiting = 0
        self.kv_cache_usage = 0.0

    def factory(self, _vllm_config: Any, _engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        tracker = self

        class _Logger(StatLoggerBase):
            def __init__(self) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    tracker.waiting = scheduler_stats.num_waiting_reqs
                    tracker.kv_cache_usage = scheduler_stats.kv_cache_usage

            def log_engine_initialized(self) -> None:
                pass

        return _Logger()


@dataclass
class PreparedPrompt:
    engine_input: Any
    sampling_params: Any
    prompt_tokens: int
    # The prompt's text, when the response must echo it (completions' ``echo``).
    echo_text: str | None = None
    # Prompted key -> plain key, when the schema prompts inside keys (worker.spans).
    key_prompts: dict[str, str] | None = None


@dataclass(frozen=True)
class Limits:
    """TGI-style serving limits, in tokens; 0 means no limit beyond the model's."""

    max_input_tokens: int = 0
    max_total_tokens: int = 0


class Engine:
    """One ``AsyncLLM`` and the request handling around it."""

    # What ``vllm serve`` reports as ``system_fingerprint`` (set from the config).
    system_fingerprint: str = ""

    def __init__(self, namespace: argparse.Namespace, limits: Limits | None = None) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = AsyncEngineArgs.from_cli_args(namespace)
        self.load_tracker = LoadTracker()
        self.llm = AsyncLLM.from_engine_args(
            engine_args,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[self.load_tracker.factory],
        )
        self.model_config = self.llm.model_config
        self.served_model_names: list[str] = list(
            self.model_config.served_model_name
            if isinstance(self.model_config.served_model_name, list)
            else [self.model_config.served_model_name or self.model_config.model]
        )
        # LoRA adapters (--lora-modules) are models of this worker too: a
        # request names one, and its requests run with that adapter.
        self.loras = _lora_requests(getattr(namespace, "lora_modules", None))
        self.served_model_names += [
            name for name in self.loras if name not in self.served_model_names
        ]
        self.max_model_len: int = self.model_config.max_model_len
        self.limits = limits or Limits()
        self.max_num_seqs: int = self.llm.vllm_config.scheduler_config.max_num_seqs
        # Under vLLM's priority policy the engine runs interactive requests
        # before a batch job's lines (Generate.priority); under the default
        # (fcfs) the gateway's admission alone keeps batch lines behind.
        self.scheduling_policy = str(self.llm.vllm_config.scheduler_config.policy)
        log.info(
            "scheduling policy %s: %s",
            self.scheduling_policy,
            "batch lines run after interactive requests"
            if self.priority_scheduling
            else "request priorities ignored",
        )
        # The model's generation_config.json defaults, as vllm serve applies them.
        self.default_sampling_params: dict[str, Any] = self.model_config.get_diff_sampling_param()
        self.special_ids = frozenset(self.llm.renderer.get_tokenizer().all_special_ids)
        self.system_fingerprint = _system_fingerprint(self.llm.vllm_config)
        self.namespace = namespace
        # Set by start(): vLLM's app and its renderer, which both paths use,
        # so a chat renders alike (--chat-template, its content format, ...).
        self.vllm_app: VllmApp | None = None
        self.renderer: Any = None
        # vLLM streams chats in another shape under a tool or reasoning
        # parser; under a reasoning parser, only its server builds them.
        self.reasoning_parser = bool(getattr(namespace, "reasoning_parser", None))
        self.chat_parser = self.reasoning_parser or bool(
            getattr(namespace, "tool_call_parser", None)
        )

    async def start(self) -> None:
        """Build vLLM's own server app over this engine (``worker.vllm_app``)."""
        self.vllm_app = await VllmApp.create(self.llm, self.namespace)
        self.renderer = self.vllm_app.app.state.online_renderer

    @property
    def priority_scheduling(self) -> bool:
        return self.scheduling_policy == "priority"

    def engine_priority(self, priority: int) -> int:
        """The vLLM priority for a request the gateway sent with ``priority``."""
        return priority if self.priority_scheduling else 0

    async def prepare(
        self, kind: protocol.RequestKind, params: dict[str, Any]
    ) -> list[PreparedPrompt]:
        """Validate, render and tokenize one request: one entry per prompt."""
        applied = spans.apply(kind, params)
        if applied.grammar_rules:
            log.info(
                "span grammar: %d rules, built in %.1f ms",
                applied.grammar_rules,
                applied.build_seconds * 1000,
            )
        request = sampling.parse_request(kind, applied.params)
        engine_inputs = await self._render(kind, request)
        prepared = []
        for engine_input in engine_inputs:
            prompt_tokens = sampling.prompt_length(self.model_config, engine_input)
            context = self._check_limits(kind, request, prompt_tokens)
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
        return prepared

    async def _render(self, kind: protocol.RequestKind, request: Any) -> list[Any]:
        """The engine inputs of a parsed request: the chat template applied, tokenized."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if kind == "chat":
            rendered = await self.renderer.render_chat(request)
            if isinstance(rendered, ErrorResponse):
                raise _error_from_response(rendered)
            _conversation, engine_inputs = rendered
            return list(engine_inputs)
        rendered_cmpl = await self.renderer.render_completion(request)
        if isinstance(rendered_cmpl, ErrorResponse):
            raise _error_from_response(rendered_cmpl)
        return list(rendered_cmpl)

    def _check_limits(self, kind: protocol.RequestKind, request: Any, prompt_tokens: int) -> int:
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
            text = self.llm.renderer.get_tokenizer().decode(token_ids)
        return str(text)

    async def run(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        trace: dict[str, str] | None = None,
        model: str = "",
        priority: int = 0,
    ) -> AsyncIterator[list[protocol.Delta]]:
        """Run every prompt of one request; yield its deltas as they come.

        Choice ``i`` of prompt ``p`` gets index ``p * n + i``, as in vLLM's
        completions endpoint. The last item carries the request's usage.
        ``trace`` (the gateway's trace context) parents vLLM's own spans,
        when the worker runs with ``--otlp-traces-endpoint``. ``priority`` is
        the gateway's (``Generate.priority``), applied under the priority policy.
        """
        from vllm.utils.async_utils import merge_async_iterators

        lora = self.loras.get(model)
        priority = self.engine_priority(priority)
        generators = [
            self.llm.generate(
                p.engine_input,
                p.sampling_params,
                f"{request_id}-{i}",
                lora_request=lora,
                trace_headers=trace,
                priority=priority,
            )
            for i, p in enumerate(prompts)
        ]
        completion_tokens = 0
        echoed: set[int] = set()
        rewriters: dict[int, KeyRewriter] = {}
        async for prompt_index, output in merge_async_iterators(*generators):
            prompt = prompts[prompt_index]
            n = prompt.sampling_params.n
            want_logprobs = prompt.sampling_params.logprobs is not None
            deltas = []
            for choice in output.outputs:
                completion_tokens += len(choice.token_ids)
                index = prompt_index * n + choice.index
                echo = echo_logprobs = echo_ids = None
                if prompt.echo_text is not None and index not in echoed:
                    echoed.add(index)
                    echo = prompt.echo_text
                    echo_ids = list(output.prompt_token_ids or [])
                    if want_logprobs and output.prompt_logprobs is not None:
                        echo_logprobs = self._prompt_logprobs(
                            output.prompt_token_ids or [], output.prompt_logprobs
                        )
                deltas.append(
                    protocol.Delta(
                        request_id=request_id,
                        index=index,
                        echo=echo,
                        echo_logprobs=echo_logprobs,
                        prompt_token_ids=echo_ids,
                        text=_rewrite_keys(
                            request_id, rewriters, index, prompt, choice.text, choice.finish_reason
                        ),
                        num_tokens=len(choice.token_ids),
                        logprobs=(
                            _token_logprobs(choice.token_ids, choice.logprobs, self.special_ids)
                            if want_logprobs and choice.logprobs is not None
                            else None
                        ),
                        finish_reason=choice.finish_reason,
                        stop_reason=choice.stop_reason,
                    )
                )
            if deltas:
                yield deltas
        usage = protocol.Usage(
            prompt_tokens=sum(p.prompt_tokens for p in prompts),
            completion_tokens=completion_tokens,
        )
        yield [protocol.Delta(request_id=request_id, index=0, usage=usage)]

    async def passthrough(
        self, request_id: str, params: dict[str, Any], model: str = "", priority: int = 0
    ) -> AsyncIterator[list[protocol.Delta]]:
        """A request to a route of vLLM's own server (``worker.vllm_app``): its
        body's bytes as ``raw`` deltas, then the usage it reported (zero when
        a stream did not ask for it). ``model`` is the served model the
        gateway chose (an alias or a spill-over tier names another)."""
        if self.vllm_app is None:
            raise RequestError(503, "this worker has not started vLLM's server yet")
        params = await self._within_limits(self._with_spans(params))
        body = params.get("body")
        if isinstance(body, dict) and body.get("model") and model:
            body = {**body, "model": model}
            params = {**params, "body": body}
        streamed = isinstance(body, dict) and bool(body.get("stream"))
        usage = protocol.Usage(0, 0)
        whole: list[bytes] = []
        async for chunk in self.vllm_app.run(request_id, params, self.engine_priority(priority)):
            if streamed:
                usage = _stream_usage(chunk) or usage
            else:
                whole.append(chunk)
            yield [protocol.Delta(request_id=request_id, index=0, raw=chunk)]
        if whole:
            usage = _body_usage(b"".join(whole)) or usage
        yield [protocol.Delta(request_id=request_id, index=0, usage=usage)]

    def _with_spans(self, params: dict[str, Any]) -> dict[str, Any]:
        """Span extraction (``worker.spans``) applies on vLLM's path too; prompting
        inside keys needs our output path, so it is refused there."""
        kind = GENERATION_ROUTES.get(str(params.get("path")))
        body = params.get("body")
        if kind is None or not isinstance(body, dict):
            return params
        applied = spans.apply(kind, body)
        if applied.key_prompts:
            raise RequestError(
                400,
                "x-key-prompt cannot be combined with fields answered by vLLM's own "
                "server (tools, prompt_logprobs, ...).",
                "response_format",
            )
        return {**params, "body": applied.params}

    async def _within_limits(self, params: dict[str, Any]) -> dict[str, Any]:
        """This worker's --max-input-tokens / --max-total-tokens hold on vLLM's
        path too: the prompt is measured as on ours (400 over a limit), and an
        unset max_tokens becomes what the total limit leaves, as on ours."""
        kind = GENERATION_ROUTES.get(str(params.get("path")))
        body = params.get("body")
        limits = self.limits
        if kind is None or not isinstance(body, dict):
            return params
        if not (limits.max_input_tokens or limits.max_total_tokens):
            return params
        # Measured only: vLLM's server parses and checks the rest, and
        # refuses a body it cannot parse in its own words.
        try:
            request = sampling.parse_request(kind, body)
        except RequestError:
            return params
        lengths = [
            sampling.prompt_length(self.model_config, engine_input)
            for engine_input in await self._render(kind, request)
        ]
        for prompt_tokens in lengths:
            self._check_limits(kind, request, prompt_tokens)
        if not limits.max_total_tokens:
            return params
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            left = limits.max_total_tokens - max(lengths)
            body = {**body, "max_tokens": max(left, 1)}
        return {**params, "body": body}

    def _prompt_logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[Any]
    ) -> list[protocol.TokenLogprob]:
        """The prompt's tokens as ``echo`` with ``logprobs`` reports them, like vLLM.

        The engine scores every prompt token but the first (``None``); that one
        is decoded by the tokenizer and marked unscored.
        """
        scored = _token_logprobs(token_ids, logprobs, self.special_ids)
        if token_ids and len(logprobs) and not logprobs[0]:  # None, or empty when flat
            decode = self.llm.renderer.get_tokenizer().decode
            first = token_ids[0]
            scored[0] = protocol.TokenLogprob(
                token=decode(first), logprob=0.0, token_id=first, scored=False
            )
        return scored

    def load(self) -> tuple[int, int, float]:
        """(running, waiting, KV-cache usage) of the engine, now.

        The unfinished count is exact at any moment (an aborted request leaves
        it at once); the scheduler's split of it into running and waiting is as
        of the last engine step, which is stale only while the engine is idle.
        """
        unfinished = self.llm.get_num_unfinished_requests()
        waiting = min(self.load_tracker.waiting, unfinished)
        kv_usage = self.load_tracker.kv_cache_usage if unfinished else 0.0
        return unfinished - waiting, waiting, kv_usage

    def shutdown(self) -> None:
        self.llm.shutdown()


def _rewrite_keys(
    request_id: str,
    rewriters: dict[int, KeyRewriter],
    index: int,
    prompt: PreparedPrompt,
    text: str,
    finish_reason: str | None,
) -> str:
    """``text`` with prompted keys made plain (worker.key_prompts); as is without them."""
    if not prompt.key_prompts:
        return text
    rewriter = rewriters.get(index)
    if rewriter is None:
        rewriter = rewriters[index] = KeyRewriter(prompt.key_prompts)
    out = rewriter.feed(text, final=finish_reason is not None)
    if finish_reason is not None:
        log.info(
            "request %s choice %d: prompted keys generated: %s",
            request_id,
            index,
            ", ".join(rewriter.generated) or "none",
        )
    return out


# vLLM reports -inf for impossible tokens; JSON has no infinity, and vLLM's
# own server clamps to this value.
_MIN_LOGPROB = -9999.0


def _token_logprobs(
    token_ids: Iterable[int], logprobs: Iterable[Any], special_ids: frozenset[int]
) -> list[protocol.TokenLogprob]:
    out = []
    for token_id, step in zip(token_ids, logprobs, strict=False):
        step = step or {}
        chosen = step.get(token_id)
        ranked = sorted(step.items(), key=lambda kv: kv[1].rank or 0)
        out.append(
            protocol.TokenLogprob(
                token=_token_text(chosen, token_id),
                logprob=max(chosen.logprob, _MIN_LOGPROB) if chosen else _MIN_LOGPROB,
                top=[
                    protocol.TopLogprob(
                        _token_text(lp, tid), max(lp.logprob, _MIN_LOGPROB), tid, lp.rank or 0
                    )
                    for tid, lp in ranked
                ],
                token_id=token_id,
                special=token_id in special_ids,
                rank=(chosen.rank or 0) if chosen else 0,
            )
        )
    return out


def _system_fingerprint(vllm_config: Any) -> str:
    """What ``vllm serve`` puts in ``system_fingerprint`` for this engine."""
    from vllm.entrypoints.serve.utils.fingerprint import get_system_fingerprint

    return get_system_fingerprint(vllm_config) or ""


def _token_text(logprob: Any, token_id: int) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return str(logprob.decoded_token)
    return f"token_id:{token_id}"


def _error_from_response(response: Any) -> RequestError:
    error = response.error
    return RequestError(int(error.code), str(error.message), error.param)


def _lora_requests(modules: list[Any] | None) -> dict[str, Any]:
    """``--lora-modules`` as vLLM ``LoRARequest``s by adapter name (ids from 1, as vLLM)."""
    if not modules:
        return {}
    from vllm.lora.request import LoRARequest

    return {
        module.name: LoRARequest(lora_name=module.name, lora_int_id=i, lora_path=module.path)
        for i, module in enumerate(modules, start=1)
    }


# vLLM's routes that take a completion or chat body (and which of ours each
# is): span extraction and the token limits read these bodies on vLLM's path.
GENERATION_ROUTES: dict[str, protocol.RequestKind] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
}


def _usage_of(value: Any) -> protocol.Usage | None:
    """A response's ``usage`` (chat/completions' names or the Responses API's)."""
    usage = value.get("usage") if isinstance(value, dict) else None
    if not isinstance(usage, dict):
        if isinstance(value, dict) and isinstance(value.get("response"), dict):
            return _usage_of(value["response"])  # a Responses API event
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    if isinstance(prompt, int) and isinstance(completion, int):
        return protocol.Usage(prompt, completion)
    return None


def _body_usage(content: bytes) -> protocol.Usage | None:
    try:
        return _usage_of(json.loads(content))
    except ValueError:
        return None


def _stream_usage(chunk: bytes) -> protocol.Usage | None:
    """The usage in an SSE chunk's events, if one carries it (the last wins)."""
    if b'"usage"' not in chunk:
        return None
    found = None
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {"):
            found = _body_usage(line[6:]) or found
    return found
