"""OpenAI request bodies, as msgspec structs: what the gateway checks before routing.

The gateway validates the fields it must understand (types, ranges, the
model name, the stream flags) and forwards the body as it came, so vLLM
extension fields it does not model (``structured_outputs``,
``chat_template_kwargs``, ...) reach the worker, where vLLM's own request
types interpret them. Unknown fields are accepted and ignored here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

from gateway.errors import BadRequest
from shared.settings import HttpSettings

T = TypeVar("T", bound=msgspec.Struct)

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
# Token ids are never negative; the worker checks them against the vocabulary.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
# vLLM's bounds on ``seed`` (torch's int64); beyond them, vLLM's own error
# (``seed_out_of_range``).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
Seed = Annotated[int, msgspec.Meta(ge=SEED_MIN, le=SEED_MAX)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields common to both endpoints."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    n: PositiveInt = 1  # at most --max-n (check_limits)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of such lists.
    prompt: str | list[str | TokenId | list[TokenId]]
    echo: bool = False
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    best_of: PositiveInt | None = None
    suffix: str | None = None

    def __post_init__(self) -> None:
        prompt = self.prompt
        if isinstance(prompt, str):
            return
        if not prompt:
            raise ValueError("prompt must not be empty")
        kinds = {type(item) for item in prompt}
        if len(kinds) > 1:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of "
                "token ids, or a list of token-id lists, not a mix"
            )
        if isinstance(prompt[0], list) and not all(prompt):
            raise ValueError("prompt token-id lists must not be empty")


class ChatMessage(msgspec.Struct, kw_only=True):
    # Any string, as in vLLM (its ``CustomChatCompletionMessageParam``): a
    # role other than OpenAI's reaches the chat template as it came.
    role: str
    # Text, or OpenAI content parts ({"type": "text", "text": ...}, ...);
    # None is allowed for assistant messages that carry tool calls.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("messages must contain at least one message")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")


def check_limits(body: _Sampling, settings: HttpSettings) -> None:
    """Refuse what this server's limits forbid (TGI's flags), naming limit and value."""
    if body.n > settings.max_n:
        raise BadRequest(
            f"n is {body.n}, more than this server's --max-n of {settings.max_n}.", "n"
        )
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > settings.max_stop_sequences:
        raise BadRequest(
            f"stop has {len(stops)} sequences, more than this server's "
            f"--max-stop-sequences of {settings.max_stop_sequences}.",
            "stop",
        )


# Deepest nesting of arrays and objects a body may have. Deeper input would
# exhaust the recursion of the decoders and encoders on its way (ours,
# msgpack's, vLLM's pydantic models); no real request comes near it.
MAX_JSON_DEPTH = 64
_TOO_DEEP = f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep."


def decode_body(body: bytes) -> dict[str, Any]:
    """The JSON object in ``body``; 400 for anything else."""
    try:
        value = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise _undecodable(body, exc) from None
    except RecursionError:
        raise BadRequest(_TOO_DEEP) from None
    if not isinstance(value, dict):
        raise BadRequest("The request body must be a JSON object.")
    # Counting brackets is cheap and over-counts (strings hold some): only a
    # body with more of them than the bound can be too deep, so only such a
    # body is walked.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _too_deep(value):
        raise BadRequest(_TOO_DEEP)
    return value


def _undecodable(body: bytes, exc: Exception) -> BadRequest:
    """The 400 for a body msgspec could not decode. Bad UTF-8 is named as such
    however the installed msgspec reports it (a UnicodeDecodeError before
    0.23, a DecodeError without the reason since): the body is checked here,
    on this error path only."""
    try:
        body.decode()
    except UnicodeDecodeError as bad:
        return BadRequest(f"The request body is not valid UTF-8: {bad.reason}.")
    return BadRequest(f"The request body is not valid JSON: {exc}")


def _too_deep(value: Any) -> bool:
    """Whether ``value`` nests containers more than ``MAX_JSON_DEPTH`` deep."""
    level: list[Any] = [value]
    for _ in range(MAX_JSON_DEPTH):
        level = [
            child
            for container in level
            for child in (container.values() if isinstance(container, dict) else container)
            if isinstance(child, dict | list)
        ]
        if not level:
            return False
    return True


def validate(raw: dict[str, Any], schema: type[T]) -> T:
    """``raw`` as ``schema``; 400 naming the field at fault."""
    try:
        return msgspec.convert(raw, schema, strict=True)
    except msgspec.ValidationError as exc:
        if str(exc).endswith(" - at `$.seed`"):
            out_of_range = seed_out_of_range(raw.get("seed"))
            if out_of_range is not None:
                raise BadRequest(out_of_range, "body.seed") from exc
        message = str(exc)
        param = None
        if " - at `$." in message:
            message, _, path = message.partition(" - at `$.")
            param = path.rstrip("`")
            message = f"Invalid value for '{param}': {message}"
        raise BadRequest(message, param) from exc


# How much of a refused value vLLM's error handler echoes.
_MAX_ERROR_INPUT_CHARS = 200


def seed_out_of_range(seed: Any) -> str | None:
    """vLLM's message for an integer ``seed`` beyond its bounds, else None.

    vLLM's server answers a request its pydantic model refuses with the
    error list its ``validation_exception_handler`` renders; clients and
    vLLM's tests match on the constraint's name (``less_than_equal``,
    ``greater_than_equal``), so the gateway says it word for word.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or SEED_MIN <= seed <= SEED_MAX:
        return None
    kind, words, key, bound = (
        ("less_than_equal", "less than or equal to", "le", SEED_MAX)
        if seed > SEED_MAX
        else ("greater_than_equal", "greater than or equal to", "ge", SEED_MIN)
    )
    try:
        shown = str(seed)
    except ValueError:  # past sys.get_int_max_str_digits(), as vLLM shows it
        shown = "<int>"
    if len(shown) > _MAX_ERROR_INPUT_CHARS:
        shown = shown[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    error = {
        "type": kind,
        "loc": "body.seed",
        "msg": f"Input should be {words} {bound}",
        "input": shown,
        "ctx": {key: bound},
    }
    return f"1 validation error:\n  {error}"


class VllmRequest(msgspec.Struct, kw_only=True):
    """A body for a route of vLLM's own server (``gateway.api.vllm_routes``):
    the gateway reads only what routing needs; the worker's vLLM checks the rest."""

    model: str = ""
    stream: bool = False
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return False  # vLLM's stream carries its own usage chunk, when asked


# Fields the gateway's own response builders answer (``sse``), per route:
# every other field, vLLM's server answers in the worker (tools, prompt
# logprobs, beam search, ...), so it means what it means under `vllm serve`.
_NATIVE_COMMON = frozenset(_Sampling.__struct_fields__) | {
    "response_format",
    "structured_outputs",
    "span_source",  # worker.json_spans
}
NATIVE_FIELDS = {
    "completion": _NATIVE_COMMON | set(CompletionRequest.__struct_fields__) - {"best_of", "suffix"},
    "chat": _NATIVE_COMMON | set(ChatCompletionRequest.__struct_fields__),
}


def vllm_field(kind: Literal["completion", "chat"], raw: dict[str, Any]) -> str | None:
    """The first field of ``raw`` that only vLLM's own server answers, if any."""
    native = NATIVE_FIELDS[kind]
    for name, value in raw.items():
        if value is not None and name not in native:
            return name
    options = raw.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "stream_options.continuous_usage_stats"
    return None
