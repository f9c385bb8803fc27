"""Hugging Face TGI's generate API, mapped onto the OpenAI completions path.

TGI clients post ``{"inputs": ..., "parameters": {...}}`` to ``/generate``,
``/generate_stream`` or ``/``. Each request becomes one completions request
for the worker (:func:`to_completion`), so sampling, limits, routing and
cancellation are the ones every other request gets; the worker's deltas
come back in TGI's shapes (:class:`TgiBuilder`), and errors in TGI's body
(422 for a bad request). Parameters mean what TGI defines: a request
samples only when TGI's ``NextTokenChooser`` would. What vLLM cannot do
(``typical_p``, ``watermark``, ``best_of`` above 1, ``adapter_id``) is
refused by name (:func:`check_supported`), never ignored. The mapping,
parameter by parameter, is in docs/api.md.
"""

from __future__ import annotations

import random
from typing import Annotated, Any, Literal

import msgspec

from gateway import errors
from gateway.dialects import sse
from gateway.dialects.jsonresp import encode
from gateway.dialects.sse import event
from shared import protocol

DEFAULT_MAX_NEW_TOKENS = 100


class GenerateGrammar(msgspec.Struct):
    type: Literal["json", "regex", "json_object"]
    value: Any


class GenerateParameters(msgspec.Struct, kw_only=True):
    best_of: Annotated[int, msgspec.Meta(ge=1)] | None = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    grammar: GenerateGrammar | None = None
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = DEFAULT_MAX_NEW_TOKENS
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    return_full_text: bool | None = False
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    stop: list[str] = []
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(gt=0)] | None = None
    top_n_tokens: Annotated[int, msgspec.Meta(gt=0, le=20)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    truncate: Annotated[int, msgspec.Meta(gt=0)] | None = None
    typical_p: float | None = None
    watermark: bool = False
    adapter_id: str | None = None

    @property
    def samples(self) -> bool:
        """Whether TGI would sample rather than decode greedily."""
        return (
            self.do_sample
            or (self.temperature is not None and self.temperature != 1.0)
            or self.top_k is not None
            or (self.top_p is not None and self.top_p < 1.0)
        )


class GenerateRequest(msgspec.Struct, kw_only=True):
    inputs: str
    parameters: GenerateParameters = msgspec.field(default_factory=GenerateParameters)
    stream: bool = False
    # Not TGI's: which of the pool's models to use when it serves several.
    model: str | None = None

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("inputs must not be empty")


def check_supported(params: GenerateParameters) -> None:
    """Refuse what vLLM's engine cannot do, naming the parameter."""
    unsupported = [
        ("typical_p", params.typical_p is not None and params.typical_p < 1.0),
        ("watermark", params.watermark),
        ("best_of", params.best_of is not None and params.best_of > 1),
        ("adapter_id", params.adapter_id is not None),
    ]
    for name, used in unsupported:
        if used:
            raise errors.BadRequest(f"`{name}` is not supported by this server.", name)


def to_completion(request: GenerateRequest, model: str, stream: bool) -> dict[str, Any]:
    """The OpenAI completions body that runs ``request``, each parameter as TGI defines it."""
    params = request.parameters
    raw: dict[str, Any] = {
        "model": model,
        "prompt": request.inputs,
        "max_tokens": params.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        "stream": stream,
    }
    if params.samples:
        raw["temperature"] = params.temperature if params.temperature is not None else 1.0
        if params.top_k is not None:
            raw["top_k"] = params.top_k
        if params.top_p is not None:
            raw["top_p"] = params.top_p
        raw["seed"] = params.seed if params.seed is not None else random.randrange(2**63)
    else:
        raw["temperature"] = 0.0
    if params.repetition_penalty is not None:
        raw["repetition_penalty"] = params.repetition_penalty
    if params.frequency_penalty is not None:
        raw["frequency_penalty"] = params.frequency_penalty
    stop = params.stop or params.stop_sequences
    if stop:
        raw["stop"] = stop
    if params.truncate is not None:
        raw["truncate_prompt_tokens"] = params.truncate
    if params.grammar is not None:
        if params.grammar.type == "regex":
            raw["structured_outputs"] = {"regex": params.grammar.value}
        elif params.grammar.type == "json_object":
            raw["structured_outputs"] = {"json_object": True}
        else:
            raw["structured_outputs"] = {"json": params.grammar.value}
    if stream or params.details:
        # Every TGI token event and detail carries the token's id and logprob.
        raw["logprobs"] = params.top_n_tokens or 0
    if params.decoder_input_details:
        if stream:
            raise errors.BadRequest(
                "`decoder_input_details` is not supported when streaming tokens.",
                "decoder_input_details",
            )
        if params.details:
            raw["echo"] = True  # the prompt's tokens, scored: details.prefill
    return raw


def error_body(error: errors.GatewayError) -> dict[str, str]:
    return {"error": error.message, "error_type": _ERROR_TYPES.get(error.status, "generation")}


def error_status(error: errors.GatewayError) -> int:
    # TGI answers a request it cannot validate with 422.
    return 422 if error.status == 400 else error.status


_ERROR_TYPES = {
    400: "validation",
    401: "authentication",
    404: "validation",
    413: "validation",
    429: "overloaded",
    503: "unhealthy",
    504: "timeout",
}


def finish_reason(reason: str | None, stop_reason: str | int | None) -> str:
    """vLLM's finish and stop reasons as TGI names them."""
    if reason == "length":
        return "length"
    if isinstance(stop_reason, str):
        return "stop_sequence"
    return "eos_token"


def _token(token: protocol.TokenLogprob) -> dict[str, Any]:
    return {
        "id": token.token_id,
        "text": token.token,
        "logprob": token.logprob,
        "special": token.special,
    }


def _prefill_token(token: protocol.TokenLogprob) -> dict[str, Any]:
    # TGI's InputToken: the first prompt token has no logprob.
    return {
        "id": token.token_id,
        "text": token.token,
        "logprob": token.logprob if token.scored else None,
    }


def _top_tokens(token: protocol.TokenLogprob, limit: int) -> list[dict[str, Any]]:
    return [
        # Whether an alternative is special is known only for the chosen token.
        {
            "id": top.token_id,
            "text": top.token,
            "logprob": top.logprob,
            "special": token.special and top.token_id == token.token_id,
        }
        for top in token.top[:limit]
    ]


class TgiBuilder(sse.ResponseBuilder):
    """Deltas of one TGI request -> ``/generate`` JSON or ``/generate_stream`` events.

    A stream is one event per generated token; the last one also carries
    ``generated_text`` (and ``details`` when asked). TGI streams end without
    a ``[DONE]`` marker.
    """

    done = b""

    def __init__(
        self, model: str, request: GenerateRequest, seed: int | None, as_list: bool = False
    ) -> None:
        super().__init__("", model, 1)
        params = request.parameters
        self.prefix = request.inputs if params.return_full_text else ""
        self.details = params.details
        self.top_n = params.top_n_tokens or 0
        self.seed = seed
        self.as_list = as_list
        self.generated = 0

    def reset(self) -> None:
        super().reset()
        self.generated = 0

    def error_event(self, error: errors.GatewayError) -> bytes:
        return event(error_body(error))

    def body(self, usage: protocol.Usage) -> bytes:
        choice = self.choices[0]
        # With decoder_input_details the worker echoed the prompt first: not generated.
        generated = "".join(choice.text)[len(choice.echo) :]
        payload: dict[str, Any] = {"generated_text": self.prefix + generated}
        if self.details:
            tokens = choice.logprobs
            payload["details"] = {
                "finish_reason": finish_reason(choice.finish_reason, choice.stop_reason),
                "generated_tokens": usage.completion_tokens,
                "seed": self.seed,
                "prefill": [_prefill_token(t) for t in choice.echo_logprobs],
                "tokens": [_token(t) for t in tokens],
                "top_tokens": [_top_tokens(t, self.top_n) for t in tokens] if self.top_n else [],
            }
        return encode([payload] if self.as_list else payload)

    def chunk(self, delta: protocol.Delta) -> bytes:
        choice = self._choice(0)
        choice.add(delta)
        tokens = delta.logprobs or []
        finished = delta.finish_reason is not None
        events = []
        for position, token in enumerate(tokens):
            self.generated += 1
            events.append(
                self._event(token, choice if finished and position == len(tokens) - 1 else None)
            )
        if finished and not tokens:
            # The engine ended the sequence without a new token (rare): TGI's
            # last event still needs one, so it gets an empty special token.
            empty = protocol.TokenLogprob(token="", logprob=0.0, special=True)
            events.append(self._event(empty, choice))
        return b"".join(events)

    def _event(self, token: protocol.TokenLogprob, last: sse._Choice | None) -> bytes:
        payload: dict[str, Any] = {
            "index": self.generated,
            "token": _token(token),
            "top_tokens": _top_tokens(token, self.top_n) if self.top_n else None,
            "generated_text": None,
            "details": None,
        }
        if last is not None:
            payload["generated_text"] = self.prefix + "".join(last.text)
            if self.details:
                payload["details"] = {
                    "finish_reason": finish_reason(last.finish_reason, last.stop_reason),
                    "generated_tokens": self.generated,
                    "seed": self.seed,
                }
        return event(payload)
