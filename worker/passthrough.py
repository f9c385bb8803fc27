"""A request for vLLM's own server (``worker.vllm_app``), with this worker's rules applied.

Before the body reaches vLLM's app, what holds on our path holds here too:
span extraction (``worker.json_spans``) and the token limits (``--max-input-tokens``,
``--max-total-tokens``, measured as ``worker.prepare`` measures them). The
app's bytes go back as ``raw`` deltas as they come; the usage the gateway
accounts for is read from those bytes, since no ``RequestOutput`` passes here.
A chat or completion stream always asks vLLM for its usage, whether or not
its client did (``worker.stream_usage``), so each delta carries the tokens
computed so far and the last one the whole count.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from shared import protocol, routes
from worker import json_spans, sampling
from worker.errors import RequestError
from worker.prepare import Preparer
from worker.stream_usage import StreamUsage
from worker.vllm_app import VllmApp

# vLLM's routes that take a completion or chat body (and which of ours each
# is): span extraction and the token limits read these bodies on vLLM's path.
GENERATION_ROUTES: dict[str, protocol.RequestKind] = {
    route.path: route.generates for route in routes.ROUTES if route.generates is not None
}


class Passthrough:
    """Runs requests through vLLM's app over the worker's engine."""

    def __init__(self, app: VllmApp, preparer: Preparer, system_fingerprint: str = "") -> None:
        self.app = app
        self.preparer = preparer
        self.system_fingerprint = system_fingerprint

    async def run(
        self, request_id: str, params: dict[str, Any], model: str, priority: int
    ) -> AsyncIterator[list[protocol.Delta]]:
        """The body's bytes as ``raw`` deltas, then the usage it reported.
        ``model`` is the served model the gateway chose (an alias or a
        spill-over tier names another); ``priority`` is the engine's."""
        params = await self._within_limits(self._with_spans(params))
        body = params.get("body")
        if isinstance(body, dict) and body.get("model") and model:
            body = {**body, "model": model}
            params = {**params, "body": body}
        streamed = isinstance(body, dict) and bool(body.get("stream"))
        if streamed and str(params.get("path")) in GENERATION_ROUTES:
            assert isinstance(body, dict)
            tap = StreamUsage(body, self.system_fingerprint)
            params = {**params, "body": tap.body}
            async for delta in self._counted(request_id, params, priority, tap):
                yield delta
            return
        usage = protocol.Usage(0, 0)
        whole: list[bytes] = []
        async for chunk in self.app.run(request_id, params, priority):
            if streamed:
                usage = stream_usage(chunk) or usage
            else:
                whole.append(chunk)
            yield [protocol.Delta(request_id=request_id, index=0, raw=chunk)]
        if whole:
            usage = body_usage(b"".join(whole)) or usage
        yield [protocol.Delta(request_id=request_id, index=0, usage=usage)]

    async def _counted(
        self, request_id: str, params: dict[str, Any], priority: int, tap: StreamUsage
    ) -> AsyncIterator[list[protocol.Delta]]:
        """A chat or completion stream through ``tap``: each delta with the
        tokens its bytes add, the last with vLLM's count of the whole."""
        async for chunk in self.app.run(request_id, params, priority):
            text, prompt, completion = tap.feed(chunk)
            if text or prompt or completion:
                yield [
                    protocol.Delta(
                        request_id=request_id,
                        index=0,
                        raw=text,
                        num_tokens=completion,
                        prompt_tokens=prompt,
                    )
                ]
        rest = tap.rest()
        if rest:
            yield [protocol.Delta(request_id=request_id, index=0, raw=rest)]
        usage = tap.usage or protocol.Usage(tap.prompt_tokens, tap.completion_tokens)
        yield [protocol.Delta(request_id=request_id, index=0, usage=usage)]

    def _with_spans(self, params: dict[str, Any]) -> dict[str, Any]:
        """Span extraction applies on vLLM's path too; prompting inside keys
        needs our output path, so it is refused there."""
        kind = GENERATION_ROUTES.get(str(params.get("path")))
        body = params.get("body")
        if kind is None or not isinstance(body, dict):
            return params
        applied = json_spans.apply(kind, body)
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
        limits = self.preparer.limits
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
        lengths = await self.preparer.prompt_lengths(kind, request)
        for prompt_tokens in lengths:
            self.preparer.check_limits(kind, request, prompt_tokens)
        if not limits.max_total_tokens:
            return params
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            left = limits.max_total_tokens - max(lengths)
            body = {**body, "max_tokens": max(left, 1)}
        return {**params, "body": body}


def usage_of(value: Any) -> protocol.Usage | None:
    """A response's ``usage`` (chat/completions' names or the Responses API's)."""
    usage = value.get("usage") if isinstance(value, dict) else None
    if not isinstance(usage, dict):
        if isinstance(value, dict) and isinstance(value.get("response"), dict):
            return usage_of(value["response"])  # a Responses API event
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    if isinstance(prompt, int) and isinstance(completion, int):
        return protocol.Usage(prompt, completion)
    return None


def body_usage(content: bytes) -> protocol.Usage | None:
    """The usage in a whole JSON body, if it carries one."""
    try:
        return usage_of(json.loads(content))
    except ValueError:
        return None


def stream_usage(chunk: bytes) -> protocol.Usage | None:
    """The usage in an SSE chunk's events, if one carries it (the last wins)."""
    if b'"usage"' not in chunk:
        return None
    found = None
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {"):
            found = body_usage(line[6:]) or found
    return found
