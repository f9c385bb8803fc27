"""The worker's model: vLLM's ``AsyncLLM``, and the parts around it composed into one engine.

We reuse vLLM's pieces rather than re-implement them, so a request means the
same here as under ``vllm serve``: ``AsyncEngineArgs`` parses every vLLM
flag, and the request handling is split by job, as vLLM's v1 engine splits
its own front end:

* ``worker.prepare``: a request's body → rendered prompts and
  ``SamplingParams``, within this server's limits (vLLM's ``InputProcessor``);
* ``AsyncLLM.generate``: the engine core, in its own process;
* ``worker.outputs``: ``RequestOutput``s → ``Delta`` items (its
  ``OutputProcessor``);
* ``worker.passthrough``: what text deltas cannot carry (tool calls, the
  Responses API, ``/tokenize``, ...) answered by vLLM's own server app
  (``worker.vllm_app``).

This module starts the engine, keeps its load figures for the heartbeats,
and runs a prepared request's prompts.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from typing import Any

from shared import protocol
from worker.errors import RequestError
from worker.outputs import RequestDeltas
from worker.passthrough import Passthrough
from worker.prepare import Limits, PreparedPrompt, Preparer
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


class Engine:
    """One ``AsyncLLM`` and the request handling around it."""

    # What ``vllm serve`` reports as ``system_fingerprint`` (set from the config).
    system_fingerprint: str = ""
    # Set by start(), once vLLM's app exists: its renderer prepares our
    # requests too, so a chat renders alike on both paths.
    preparer: Preparer | None = None
    vllm_requests: Passthrough | None = None

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
            "requests run by band: interactive, then standard, then batch"
            if self.priority_scheduling
            else "request priorities ignored",
        )
        # The model's generation_config.json defaults, as vllm serve applies them.
        self.default_sampling_params: dict[str, Any] = self.model_config.get_diff_sampling_param()
        self.tokenizer = self.llm.renderer.get_tokenizer()
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        self.system_fingerprint = _system_fingerprint(self.llm.vllm_config)
        self.namespace = namespace
        # vLLM streams chats in another shape under a tool or reasoning
        # parser; under a reasoning parser, only its server builds them.
        events = self.llm.vllm_config.kv_events_config
        self.kv_events_port = kv_events_port(events)
        self.kv_replay_port = kv_events_port(events, replay=True)
        self.kv_block_size: int = self.llm.vllm_config.cache_config.block_size or 0
        self.reasoning_parser = bool(getattr(namespace, "reasoning_parser", None))
        self.chat_parser = self.reasoning_parser or bool(
            getattr(namespace, "tool_call_parser", None)
        )

    async def start(self) -> None:
        """Build vLLM's own server app over this engine (``worker.vllm_app``),
        and the request handling that uses it."""
        app = await VllmApp.create(self.llm, self.namespace)
        self.preparer = Preparer(
            self.model_config,
            app.app.state.online_renderer,
            self.tokenizer,
            self.limits,
            self.default_sampling_params,
        )
        self.vllm_requests = Passthrough(app, self.preparer, self.system_fingerprint)

    @property
    def priority_scheduling(self) -> bool:
        return self.scheduling_policy == "priority"

    def describe_tokenizer(self) -> tuple[str, str, dict[str, str]] | None:
        """Its tokenizer's JSON, the chat template it applies and the special tokens
        that template names (``protocol.Tokenizer``); None without a fast tokenizer."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        from vllm.renderers.chat_utils import load_chat_template

        # --chat-template (a file or the template itself), as vLLM's server loads it.
        template = load_chat_template(getattr(self.namespace, "chat_template", None))
        if template is None:
            template = getattr(self.tokenizer, "chat_template", None) or ""
        special = {
            name: str(value)
            for name, value in getattr(self.tokenizer, "special_tokens_map", {}).items()
            if isinstance(value, str)
        }
        return backend.to_str(), str(template), special

    def engine_priority(self, priority: int) -> int:
        """The vLLM priority for a request the gateway sent with ``priority``."""
        return priority if self.priority_scheduling else 0

    async def prepare(
        self,
        kind: protocol.RequestKind,
        params: dict[str, Any],
        continuation: protocol.Continuation | None = None,
    ) -> list[PreparedPrompt]:
        """Validate, render and tokenize one request: one entry per prompt."""
        if self.preparer is None:
            raise _not_started()
        return await self.preparer.prepare(kind, params, continuation)

    async def run(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        trace: dict[str, str] | None = None,
        model: str = "",
        priority: int = 0,
    ) -> AsyncIterator[list[protocol.Delta]]:
        """Run every prompt of one request; yield its deltas as they come.

        The last item carries the request's usage (``worker.outputs``).
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
        outputs = RequestDeltas(request_id, prompts, self.tokenizer, self.special_ids)
        merged = merge_async_iterators(*generators)
        try:
            async for prompt_index, output in merged:
                deltas = outputs.step(prompt_index, output)
                if deltas:
                    yield deltas
                if outputs.stopped:
                    # A stop string across a continued answer's seam, which
                    # vLLM did not see: closing aborts it in the engine.
                    break
        finally:
            await merged.aclose()
        yield outputs.usage()

    async def passthrough(
        self, request_id: str, params: dict[str, Any], model: str = "", priority: int = 0
    ) -> AsyncIterator[list[protocol.Delta]]:
        """A request to a route of vLLM's own server (``worker.passthrough``):
        its body's bytes as ``raw`` deltas, then the usage it reported."""
        if self.vllm_requests is None:
            raise _not_started()
        outputs = self.vllm_requests.run(request_id, params, model, self.engine_priority(priority))
        async for deltas in outputs:
            yield deltas

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


def _not_started() -> RequestError:
    return RequestError(503, "this worker has not started vLLM's server yet")


def _system_fingerprint(vllm_config: Any) -> str:
    """What ``vllm serve`` puts in ``system_fingerprint`` for this engine."""
    from vllm.entrypoints.serve.utils.fingerprint import get_system_fingerprint

    return get_system_fingerprint(vllm_config) or ""


def _lora_requests(modules: list[Any] | None) -> dict[str, Any]:
    """``--lora-modules`` as vLLM ``LoRARequest``s by adapter name (ids from 1, as vLLM)."""
    if not modules:
        return {}
    from vllm.lora.request import LoRARequest

    return {
        module.name: LoRARequest(lora_name=module.name, lora_int_id=i, lora_path=module.path)
        for i, module in enumerate(modules, start=1)
    }


def kv_events_port(config: Any, replay: bool = False) -> int:
    """The TCP port vLLM's ``--kv-events-config`` publishes KV cache events on (with
    ``replay``: answers requests for missed batches on), when it publishes them over
    ZeroMQ on a TCP port this host binds; else 0."""
    if config is None or not config.enable_kv_cache_events or config.publisher != "zmq":
        return 0
    endpoint = str((config.replay_endpoint if replay else config.endpoint) or "")
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        return 0
    try:
        return int(endpoint.rsplit(":", 1)[1])
    except ValueError:
        return 0
