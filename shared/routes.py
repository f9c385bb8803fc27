"""The route table: every route of the gateway's HTTP API, each declared once.

One row per path (Starlette's path syntax, ``{param}`` for a segment): its
methods, its error dialect, who answers it, and what else it is. Everything
that needs to know the routes is built from this table:

* the gateway's FastAPI routes and ``/openapi.json`` (``gateway.endpoints``),
  the fast path for the builder routes (``gateway.api.direct``), and the
  dialect of every error a route answers, 404 and 405 included;
* the paths open without an API key, and those for admin keys only
  (``gateway.api.auth``), and the endpoints a batch line may name
  (``gateway.batch.jsonl``);
* the worker's allow-list for vLLM's server (``worker.vllm_app``) and the
  routes whose bodies it reads as a completion or a chat (``worker.passthrough``).

It lives in ``shared`` because both sides read it, and the worker imports
nothing from the gateway. It imports nothing but the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

Method = Literal["GET", "POST", "DELETE"]
# The shape of an error on the route: OpenAI's {"error": {...}} or TGI's
# {"error", "error_type"} (422 for a bad body).
Dialect = Literal["openai", "tgi"]
# Who answers it:
# * builder: the gateway, its response builders (gateway.dialects.sse, gateway.dialects.tgi)
#   over a worker's deltas;
# * vllm: vLLM's own server code in a worker (worker.vllm_app), forwarded;
# * models: the gateway, from the models its workers serve and the pools file;
# * batch: the gateway's Files and Batches API (gateway.batch);
# * usage: the gateway's usage per API key (gateway.api.usage_routes);
# * ops: the gateway's health, readiness and metrics, for probes and Prometheus.
Kind = Literal["builder", "vllm", "models", "batch", "usage", "ops"]
# Whether a request needs an API key (when keys are configured): always; never
# (load balancers and probes carry none); or an admin one (what every key
# did shows there: operators only).
Key = Literal["always", "never", "admin"]
# What a route's body is to the worker, when it is a completion or a chat.
Generates = Literal["completion", "chat"]

_PARAM = re.compile(r"{([A-Za-z_][A-Za-z0-9_]*)}")


@dataclass(frozen=True, slots=True)
class Route:
    path: str
    methods: tuple[Method, ...]
    kind: Kind
    dialect: Dialect = "openai"
    # Its body is a completion or a chat request: vLLM's server answers it when
    # the body uses a field only vLLM answers (tools, prompt logprobs, ...).
    generates: Generates | None = None
    # A line of a batch input file may name it as its ``url``.
    batchable: bool = False
    key: Key = "always"
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Starlette's default `{param}`: one non-empty segment.
        parts = _PARAM.split(self.path)
        regex = "".join(
            re.escape(part) if i % 2 == 0 else f"(?P<{part}>[^/]+)" for i, part in enumerate(parts)
        )
        object.__setattr__(self, "pattern", re.compile(regex))

    @property
    def forwarded(self) -> bool:
        """Whether a worker's vLLM server may answer it: always for vLLM's own
        routes, and for a completion or chat that needs it."""
        return self.kind == "vllm" or self.generates is not None

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(_PARAM.findall(self.path))

    def url(self, **params: str) -> str:
        """The path with its parameters filled in: ``BATCH.url(batch_id="b1")``."""
        return self.path.format(**params)

    def matches(self, path: str) -> bool:
        return self.pattern.fullmatch(path) is not None


# -- answered by the gateway's builders -------------------------------------------
COMPLETIONS = Route("/v1/completions", ("POST",), "builder", generates="completion", batchable=True)
CHAT = Route("/v1/chat/completions", ("POST",), "builder", generates="chat", batchable=True)
TGI_GENERATE = Route("/generate", ("POST",), "builder", "tgi")
TGI_GENERATE_STREAM = Route("/generate_stream", ("POST",), "builder", "tgi")
# TGI's compatibility route, the one its Python client posts to.
TGI_COMPAT = Route("/", ("POST",), "builder", "tgi")

MODELS = Route("/v1/models", ("GET",), "models")

# -- OpenAI's Files and Batches ---------------------------------------------------
FILES = Route("/v1/files", ("POST", "GET"), "batch")
FILE = Route("/v1/files/{file_id}", ("GET", "DELETE"), "batch")
FILE_CONTENT = Route("/v1/files/{file_id}/content", ("GET",), "batch")
BATCHES = Route("/v1/batches", ("POST", "GET"), "batch")
BATCH = Route("/v1/batches/{batch_id}", ("GET",), "batch")
BATCH_CANCEL = Route("/v1/batches/{batch_id}/cancel", ("POST",), "batch")

# -- usage per API key, model and day ------------------------------------------------
USAGE = Route("/v1/usage", ("GET",), "usage")

# -- vLLM's own routes, answered by vLLM's server in a worker ----------------------
# What `vllm serve` answers for text models, less its operations routes
# (metrics, health, load, scaling).
TOKENIZE = Route("/tokenize", ("POST",), "vllm")
DETOKENIZE = Route("/detokenize", ("POST",), "vllm")
INVOCATIONS = Route("/invocations", ("POST",), "vllm")
CHAT_BATCH = Route("/v1/chat/completions/batch", ("POST",), "vllm")
MESSAGES = Route("/v1/messages", ("POST",), "vllm")
MESSAGES_COUNT_TOKENS = Route("/v1/messages/count_tokens", ("POST",), "vllm")
VERSION = Route("/version", ("GET",), "vllm")
PING = Route("/ping", ("GET", "POST"), "vllm")
RESPONSES = Route("/v1/responses", ("POST",), "vllm")
RESPONSE = Route("/v1/responses/{response_id}", ("GET",), "vllm")
RESPONSE_CANCEL = Route("/v1/responses/{response_id}/cancel", ("POST",), "vllm")

# -- the gateway's own operations ---------------------------------------------------
HEALTH = Route("/health", ("GET",), "ops", key="never")
METRICS = Route("/metrics", ("GET",), "ops", key="admin")
READY = Route("/ready", ("GET",), "ops", key="never")

# In the order FastAPI declares them (and /openapi.json lists them).
ROUTES: tuple[Route, ...] = (
    COMPLETIONS,
    CHAT,
    TGI_GENERATE,
    TGI_GENERATE_STREAM,
    TGI_COMPAT,
    MODELS,
    FILES,
    FILE,
    FILE_CONTENT,
    BATCHES,
    BATCH,
    BATCH_CANCEL,
    USAGE,
    TOKENIZE,
    DETOKENIZE,
    INVOCATIONS,
    CHAT_BATCH,
    MESSAGES,
    MESSAGES_COUNT_TOKENS,
    VERSION,
    PING,
    RESPONSES,
    RESPONSE,
    RESPONSE_CANCEL,
    HEALTH,
    METRICS,
    READY,
)

_BY_PATH = {route.path: route for route in ROUTES}
_WITH_PARAMS = tuple(route for route in ROUTES if route.params)


def find(path: str) -> Route | None:
    """The route a request for ``path`` (a concrete path) is for, if any."""
    route = _BY_PATH.get(path)
    if route is not None:
        return route
    return next((route for route in _WITH_PARAMS if route.matches(path)), None)


def open_paths() -> frozenset[str]:
    """The paths a request may take without an API key."""
    return frozenset(route.path for route in ROUTES if route.key == "never")


def admin_paths() -> frozenset[str]:
    """The paths only an admin key may take (when keys are configured)."""
    return frozenset(route.path for route in ROUTES if route.key == "admin")
