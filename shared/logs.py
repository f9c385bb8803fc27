"""Logging setup shared by every process, and the request id on every log line.

Each process logs one line per record, as text (process name first) or, with
``--log-format json``, as one JSON object per line for log shippers. A record
about a request carries that request's id (``request_id``): the gateway's
names it with ``extra={"request_id": ...}`` (the client's ``X-Request-Id`` or
one it made), the worker sets the context variable below in each request's
task (the same id, which it also gives vLLM), so one id finds a request's
lines on both sides.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator

import msgspec

LOG_FORMATS = ("text", "json")

# The id of the request the current task is handling ("" outside a request).
# A context variable: asyncio copies it into every task a request starts.
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")

_TEXT = "%(asctime)s %(levelname)s %(processName)s[%(process)d] %(name)s: %(message)s%(request)s"


@contextlib.contextmanager
def for_request(rid: str) -> Iterator[None]:
    """Log lines written inside this block carry ``rid`` as their request id."""
    token = request_id.set(rid)
    try:
        yield
    finally:
        request_id.reset(token)


class _RequestIdFilter(logging.Filter):
    """Puts the current request id on the record (``request_id``, and ``request``
    as the text format's `` [request_id=...]`` suffix)."""

    def filter(self, record: logging.LogRecord) -> bool:
        # Named by the caller (extra={"request_id": ...}), or the task's own.
        rid = getattr(record, "request_id", None) or request_id.get()
        record.request_id = rid
        record.request = f" [request_id={rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, process, logger, message, request_id."""

    _encode = msgspec.json.Encoder().encode

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "process": f"{record.processName}[{record.process}]",
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", "")
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return self._encode(entry).decode()


def setup_logging(level: str, log_format: str = "text") -> None:
    """Configure the root logger: ``level`` (debug, info, ...) in ``log_format``."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    if log_format == "json":
        # Libraries with handlers of their own (vLLM's "vllm" logger, uvicorn's
        # when it configured them) write through ours instead, so every line is JSON.
        for name in ("vllm", "uvicorn", "uvicorn.error", "uvicorn.access"):
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate = True
