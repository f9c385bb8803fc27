"""vLLM's own OpenAI server, in the worker's process, over the worker's engine.

Requests whose answer needs more than text deltas (tool calls, reasoning,
prompt logprobs, returned token ids, beam search, the Responses API,
``/tokenize``, ...) come to the worker as ``Generate(kind="vllm")`` with
``params = {"method", "path", "body"}``. They are answered by the very app
``vllm serve`` runs (``build_app`` + ``init_app_state``), called in process
through ASGI on the same ``AsyncLLM``: the answer is ``vllm serve``'s by
construction, byte for byte, streamed as it produces it.

Its body goes back as :class:`shared.protocol.Delta` items with ``raw``
bytes; an error status (4xx/5xx) becomes a :class:`RequestError` with vLLM's
message, so the gateway renders it like any other error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from shared import routes
from worker.errors import RequestError

log = logging.getLogger(__name__)

# What a gateway may ask for: the route table's routes that vLLM's server
# answers (`vllm serve`'s routes for text models, less its own operations
# routes: metrics, health, load, scaling).
FORWARDED = frozenset(route for route in routes.ROUTES if route.forwarded)


def allowed(method: str, path: str) -> bool:
    """Whether ``method path`` (a concrete path) is one of :data:`FORWARDED`."""
    route = routes.find(path)
    return route is not None and route in FORWARDED and method in route.methods


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    """``vllm serve``'s request-handling flags (chat template, tool and reasoning
    parsers, ...), less those about its HTTP server, which the gateway is."""
    from vllm.entrypoints.launchers.cli_args import FrontendArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    scratch = FlexibleArgumentParser(add_help=False)  # type: ignore[no-untyped-call]
    FrontendArgs.add_cli_args(scratch)
    group = parser.add_argument_group("vLLM request handling (as `vllm serve`)")
    for action in scratch._actions:
        if action.dest in SERVER_ONLY or not action.option_strings:
            continue
        group._add_action(action)


# FrontendArgs that configure vLLM's HTTP server, not how it answers a request:
# the gateway listens, authenticates and logs access, so the worker does not
# take them (a flag accepted and ignored would mislead).
SERVER_ONLY = frozenset(
    {
        "host",
        "port",
        "uds",
        "uvicorn_log_level",
        "disable_uvicorn_access_log",
        "disable_access_log_for_endpoints",
        "allow_credentials",
        "allowed_origins",
        "allowed_methods",
        "allowed_headers",
        "api_key",
        "ssl_keyfile",
        "ssl_certfile",
        "ssl_ca_certs",
        "enable_ssl_refresh",
        "ssl_cert_reqs",
        "ssl_ciphers",
        "root_path",
        "middleware",
        "disable_fastapi_docs",
        "enable_offline_docs",
        "h11_max_incomplete_event_size",
        "h11_max_header_count",
        "log_config_file",
        "max_log_len",
        "disable_frontend_multiprocessing",
        "enable_tokenizer_info_endpoint",
        "enable_server_load_tracking",
        "help",
    }
)


def serve_namespace(namespace: argparse.Namespace) -> argparse.Namespace:
    """``namespace`` completed with ``vllm serve``'s defaults for every flag it lacks."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    defaults = make_arg_parser(FlexibleArgumentParser()).parse_args([])  # type: ignore[no-untyped-call]
    merged = vars(defaults) | vars(namespace)
    return argparse.Namespace(**merged)


def with_priority(body: Any, priority: int) -> Any:
    """``body`` to run at ``priority`` (the engine's, from the gateway's band and rank):
    its own ``priority`` field may ask to run later (a larger number), never
    sooner, or a tenant of a low band would jump the engine's queue. A field
    that is no integer is left for vLLM to refuse."""
    if not isinstance(body, dict):
        return body
    asked = body.get("priority")
    if asked is None:
        return {**body, "priority": priority} if priority else body
    if type(asked) is int and asked < priority:
        return {**body, "priority": priority}
    return body


class VllmApp:
    """vLLM's FastAPI app, its state built over ``llm`` as ``vllm serve`` builds it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    @classmethod
    async def create(cls, llm: Any, namespace: argparse.Namespace) -> VllmApp:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app

        args = serve_namespace(namespace)  # checked by worker.main
        supported_tasks = await llm.get_supported_tasks()
        # Building vLLM's app sets the root logger to ERROR (one of its
        # middlewares' imports): the worker's own INFO lines would vanish.
        root = logging.getLogger()
        level = root.level
        try:
            app = build_app(args, supported_tasks, llm.model_config)
            await init_app_state(llm, app.state, args, supported_tasks)
        finally:
            root.setLevel(level)
        return cls(app)

    async def run(
        self, request_id: str, params: dict[str, Any], priority: int = 0
    ) -> AsyncIterator[bytes]:
        """The response body of ``params["method"] params["path"]``, chunk by chunk.

        A status of 400 or more raises :class:`RequestError` with vLLM's
        error message instead. Cancelling the iteration cancels the app's
        handling, which aborts the request in the engine (as a client
        leaving ``vllm serve`` does).
        """
        method = str(params.get("method") or "POST")
        path = str(params.get("path") or "")
        if not allowed(method, path):
            raise RequestError(404, f"{method} {path} is not a route of this worker.")
        body = with_priority(params.get("body"), priority)
        content = b"" if body is None else json.dumps(body).encode()
        exchange = _Exchange(content)
        scope = _scope(method, path, content, request_id)
        task = asyncio.create_task(self._call(scope, exchange))
        try:
            status = await exchange.status()
            if status >= 400:
                raise _error(status, await exchange.rest())
            async for chunk in exchange.chunks():
                yield chunk
            await task
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _call(self, scope: dict[str, Any], exchange: _Exchange) -> None:
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Exception as exc:  # the app's own handlers answer; this is a bug there
            log.exception("vLLM's app failed on %s", scope["path"])
            exchange.fail(exc)
        finally:
            exchange.end()


class _Exchange:
    """One ASGI request/response between us and the app."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.sent_body = False
        self.disconnected = asyncio.Event()
        self.started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.error: Exception | None = None

    async def receive(self) -> dict[str, Any]:
        if not self.sent_body:
            self.sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        # The client (the gateway) never leaves while the app runs: when it
        # does, this task is cancelled instead.
        await self.disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            if not self.started.done():
                self.started.set_result(int(message["status"]))
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            if chunk:
                self.queue.put_nowait(bytes(chunk))
            if not message.get("more_body", False):
                self.queue.put_nowait(None)

    def fail(self, exc: Exception) -> None:
        self.error = exc
        if not self.started.done():
            self.started.set_result(500)

    def end(self) -> None:
        if not self.started.done():
            self.started.set_result(500)
        self.queue.put_nowait(None)

    async def status(self) -> int:
        return await self.started

    async def chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self.queue.get()) is not None:
            yield chunk
        if self.error is not None:
            raise RequestError(500, f"vLLM's server failed: {self.error}")

    async def rest(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])


def _scope(method: str, path: str, body: bytes, request_id: str) -> dict[str, Any]:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        # vLLM names its request by this header, as behind the gateway.
        (b"x-request-id", request_id.encode()),
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }


def _error(status: int, content: bytes) -> RequestError:
    """vLLM's error body (OpenAI's shape, or FastAPI's ``detail``) as a RequestError."""
    message = content.decode(errors="replace") or f"HTTP {status}"
    param = None
    try:
        parsed = json.loads(content)
    except ValueError:
        return RequestError(status, message)
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict):
            message = str(error.get("message") or message)
            param = error.get("param")
        elif "detail" in parsed:
            detail = parsed["detail"]
            message = detail if isinstance(detail, str) else json.dumps(detail)
        elif "message" in parsed:
            message = str(parsed["message"])
    return RequestError(status, message, param if isinstance(param, str) else None)
