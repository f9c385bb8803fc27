"""The wire protocol between gateways and workers: msgpack-encoded msgspec structs over ZeroMQ.

Each gateway process connects one DEALER socket to every worker's ROUTER
socket. Every frame holds one struct, and a message may carry several
(``gateway.dispatch.transport``): a worker sees ``[gateway identity, body,
...]`` and replies ``[gateway identity, body]``. Structs are ``array_like``
(no field names on the wire) and tagged, so the message kind (``"gen"``,
``"abort"``, ...) is the first array element, readable without decoding the
rest. Fields may only be appended, with defaults; anything else bumps
``PROTOCOL_VERSION``, which workers report in every ``Heartbeat`` and
gateways check before sending them work. Never pickle: a peer is untrusted
input, and a frame that does not decode is logged and dropped.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

PROTOCOL_VERSION = 5

# Generous for long prompts and big batches of deltas, small enough that a
# bad peer cannot make us allocate without bound (ZMQ_MAXMSGSIZE).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# "vllm": a route of vLLM's own server, answered by it in the worker
# (``worker.vllm_app``): params are {"method", "path", "body"}, the answer
# comes back as ``Delta.raw`` bytes.
RequestKind = Literal["completion", "chat", "vllm"]


class _Message(msgspec.Struct, array_like=True, gc=False, tag_field="k"):
    """Base of every wire message (tag first, then the fields in order)."""


class Continuation(msgspec.Struct, frozen=True):
    """An answer generated so far, which another worker goes on from."""

    token_ids: list[int]
    # Characters of its text the client has been sent: the engine holds back
    # text that may begin a stop string, which the next worker sends.
    sent_chars: int = 0


class Generate(_Message, tag="gen"):
    """Run one OpenAI request.

    ``params`` holds the request body as the gateway validated it (OpenAI and
    vLLM field names: ``prompt`` or ``messages``, ``max_tokens``, ``n``,
    ``temperature``, ...). The worker maps it onto vLLM's own request types,
    so field semantics match ``vllm serve`` exactly.
    """

    request_id: str
    model: str
    kind: RequestKind
    params: dict[str, Any]
    # Unix time after which the worker should stop working on it; 0 = none.
    deadline: float = 0.0
    # The gateway's trace context (W3C ``traceparent``/``tracestate``) when
    # tracing is on: vLLM's own spans for the request join that trace.
    trace: dict[str, str] | None = None
    # vLLM's request priority (a larger number is scheduled later):
    # ``engine_priority`` of its band and its rank in the band. Workers apply
    # it only under ``--scheduling-policy priority`` (their default).
    priority: int = 0
    # A request that moved from a worker that failed mid-answer: what its
    # one choice generated there. The worker renders the prompt as for a new
    # request, appends those tokens and generates the rest, counting them in
    # ``max_tokens`` and in the usage as tokens of the answer.
    continuation: Continuation | None = None


# Priority bands, first first: a request's band is its API key's, or a lower
# one it asks for; a batch job's lines are ``batch``.
BANDS = ("interactive", "standard", "batch")
INTERACTIVE, STANDARD, BATCH = range(len(BANDS))
# The priority of a batch job's lines (``gateway.batch``): after every other request.
BATCH_PRIORITY = BATCH
# Ranks within a band, in an engine's queue: its key's virtual tokens of
# service (gateway.dispatch.fair_share), which years of traffic do not fill.
BAND_SPAN = 1 << 48


def engine_priority(band: int, rank: int = 0) -> int:
    """The vLLM priority of a request of ``band`` ranked ``rank`` within it: every
    request of a band before any of the next, and by rank within a band."""
    return band * BAND_SPAN + min(rank, BAND_SPAN - 1)


class Abort(_Message, tag="abort"):
    request_ids: list[str]


class Ping(_Message, tag="ping"):
    gateway_id: str
    sent_at: float
    # The answer to a worker's farewell (``Heartbeat.farewell``): sent once
    # this gateway has read everything the worker sent before it.
    farewell: bool = False


class Describe(_Message, tag="describe"):
    """Send this gateway what it needs to tokenize ``model``'s prompts as the engine does."""

    model: str


class Tokenizer(_Message, tag="tokenizer"):
    """A served model's tokenizer (Hugging Face ``tokenizers`` JSON), its chat template
    (Jinja, as the engine applies it) and the special tokens the template names."""

    model: str
    tokenizer_json: str
    chat_template: str
    special_tokens: dict[str, str]
    # The LoRA adapter ``model`` names, as its engine's KV cache events name it
    # (vLLM's ``lora_name``); "" for a base model: its blocks are keyed apart.
    lora: str = ""


class TopLogprob(msgspec.Struct, array_like=True, gc=False):
    """One of the most likely tokens at a position."""

    token: str
    logprob: float
    token_id: int
    # 1 = most likely, as vLLM reports it.
    rank: int


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """One generated (or prompt) token with its log-probability and the top alternatives."""

    token: str
    logprob: float
    # The most likely tokens at this position, best first.
    top: list[TopLogprob] = []
    # The token's id and whether it is a special token (TGI's details need them).
    token_id: int = -1
    special: bool = False
    # False for a prompt token the model did not score (the first one): OpenAI
    # reports its logprob and top logprobs as null.
    scored: bool = True
    # The token's rank (1 = most likely), as vLLM reports it.
    rank: int = 0


class Usage(msgspec.Struct, array_like=True, gc=False):
    prompt_tokens: int
    completion_tokens: int


class Delta(msgspec.Struct, array_like=True, gc=False):
    """New output of one choice of one request since the previous frame."""

    request_id: str
    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    # OpenAI's finish_reason ("stop", "length"), set once, on the choice's last delta.
    finish_reason: str | None = None
    # The stop string or token id that ended the choice, as vLLM reports it.
    stop_reason: str | int | None = None
    # Set on the request's very last delta: nothing more will come for it.
    usage: Usage | None = None
    # Completions with ``echo``: the prompt's text, on the choice's first delta.
    echo: str | None = None
    # Completions with ``echo`` and ``logprobs``: the prompt's tokens, same delta.
    echo_logprobs: list[TokenLogprob] | None = None
    # Completions with ``echo``: the prompt's token ids, same delta.
    prompt_token_ids: list[int] | None = None
    # A "vllm" request: the next bytes of the body vLLM's server answered.
    raw: bytes | None = None
    # The request's prompt tokens, on the first delta the engine produced for
    # it: with ``num_tokens``, what the engine has computed so far, which is
    # what a request that ends before its usage (a client gone, a stream cut)
    # is billed for.
    prompt_tokens: int = 0
    # The ids of this delta's ``num_tokens`` tokens: what a request that moves
    # to another worker mid-answer continues from (``Generate.continuation``).
    token_ids: list[int] | None = None


class Deltas(_Message, tag="deltas"):
    items: list[Delta]


class Failed(_Message, tag="failed"):
    """A request ended in an error; ``status`` is the HTTP status to report."""

    request_id: str
    status: int
    message: str
    param: str | None = None
    # Set when the worker refused or dropped a request for a reason of its own
    # state, not the request's (a 503 the gateway retries): one of the
    # constants below, which are also the gateway's retries-metric labels.
    cause: str | None = None


# A draining worker refuses a new request: another worker takes it.
WORKER_DRAINING = "worker_draining"
# A worker that heard nothing from a gateway for --gateway-timeout drops its
# requests: the gateway was stalled, not the worker, so any worker, that one
# included, may take them again.
GATEWAY_SILENT = "gateway_silent"


class Heartbeat(_Message, tag="hb"):
    worker_id: str
    # Random per process start: a restarted worker is a new incarnation, so a
    # gateway knows its old in-flight requests there are gone.
    incarnation: str
    models: list[str]
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    # Most requests the engine runs at once (vLLM's max_num_seqs).
    capacity: int = 0
    max_model_len: int = 0
    draining: bool = False
    protocol_version: int = PROTOCOL_VERSION
    # vLLM's ``system_fingerprint`` for this engine, echoed in responses.
    system_fingerprint: str = ""
    # The pool of the config file this worker belongs to ("": none).
    pool: str = ""
    # vLLM's chat streams take another shape under a tool or reasoning parser
    # (``--tool-call-parser``/``--reasoning-parser``): the gateway builds them so.
    chat_parser: bool = False
    # A reasoning parser splits a chat's answer into reasoning and content,
    # which only vLLM's server builds: the gateway sends it every chat.
    reasoning_parser: bool = False
    # Where its engine publishes its KV cache events (vLLM's
    # --kv-events-config, ZeroMQ): the port on the worker's host, 0 = none;
    # the tokens of a cache block; the port that replays missed batches.
    kv_events_port: int = 0
    kv_block_size: int = 0
    kv_replay_port: int = 0
    # A drained worker's last word: it leaves once each gateway has answered
    # (``Ping.farewell``), so none loses its last frames to the closing
    # connection (a gateway's link drops what it has not read when it does).
    farewell: bool = False
    # Gateway processes it has heard from lately: each of them routes blind to
    # the others' requests of the last heartbeat interval (gateway ``kv``).
    gateways: int = 0


# gateway -> worker: Generate (a request to run), Abort (stop these requests:
# client gone, deadline passed), Ping (the gateway is alive; a worker aborts
# the requests of a gateway it has not heard from within its timeout),
# Describe (send the model's Tokenizer).
ToWorker = Generate | Abort | Ping | Describe
# worker -> gateway: Deltas (every request's new output since the last engine
# step, in one frame: message rate = step rate, not token rate), Failed (a
# request could not run), Heartbeat (the worker's identity, models, load, capacity),
# Tokenizer (the answer to Describe).
ToGateway = Deltas | Failed | Heartbeat | Tokenizer


def encoder() -> msgspec.msgpack.Encoder:
    """One per socket, reused for every message."""
    return msgspec.msgpack.Encoder()


def worker_decoder() -> msgspec.msgpack.Decoder[ToWorker]:
    """Decodes what a worker receives."""
    return msgspec.msgpack.Decoder(ToWorker)


def gateway_decoder() -> msgspec.msgpack.Decoder[ToGateway]:
    """Decodes what a gateway receives."""
    return msgspec.msgpack.Decoder(ToGateway)
