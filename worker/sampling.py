"""Request body -> vLLM ``SamplingParams``, through vLLM's own OpenAI request types.

The gateway forwards the OpenAI body it validated. Here vLLM's pydantic
``CompletionRequest`` / ``ChatCompletionRequest`` parse it and produce the
``SamplingParams``, with the same defaults (the model's generation config)
and the same ``max_tokens`` rules as ``vllm serve``. Any error becomes a
:class:`worker.errors.RequestError` with the HTTP status and the parameter
at fault.
"""

from __future__ import annotations

from typing import Any

from shared import protocol
from worker.errors import RequestError


def parse_request(kind: protocol.RequestKind, params: dict[str, Any]) -> Any:
    """vLLM's pydantic request for ``params``; 400 naming the field on a bad one."""
    import pydantic
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request_type = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        return request_type.model_validate(params)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())) or None
        raise RequestError(
            400, f"{param}: {first.get('msg')}" if param else str(exc), param
        ) from exc


def prompt_length(model_config: Any, engine_input: Any) -> int:
    from vllm.renderers.inputs.preprocess import extract_prompt_len

    return int(extract_prompt_len(model_config, engine_input))


def prompt_token_ids(model_config: Any, engine_input: Any) -> list[int]:
    from vllm.renderers.inputs.preprocess import extract_target_prompt

    return list(extract_target_prompt(model_config, engine_input).get("prompt_token_ids") or [])


def requested_max_tokens(request: Any) -> int | None:
    """What the request asks for: chat's ``max_completion_tokens`` first, else ``max_tokens``."""
    requested: int | None = getattr(request, "max_completion_tokens", None)
    if requested is None:
        requested = request.max_tokens
    return requested


def to_sampling_params(
    request: Any, prompt_tokens: int, max_model_len: int, defaults: dict[str, Any]
) -> Any:
    """vLLM's ``SamplingParams`` for one prompt of ``request``.

    ``max_tokens`` follows vllm serve: the request's value (chat:
    ``max_completion_tokens`` first), else the model's default, capped by
    what is left of the context after the prompt.
    """
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.exceptions import VLLMValidationError

    requested = requested_max_tokens(request)
    try:
        max_tokens = get_max_tokens(
            max_model_len,
            requested,
            prompt_tokens,
            defaults,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
        return request.to_sampling_params(max_tokens, defaults)
    except VLLMValidationError as exc:
        raise RequestError(400, str(exc), exc.parameter) from exc
    except ValueError as exc:
        raise RequestError(400, str(exc)) from exc
