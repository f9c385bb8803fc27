"""What the worker tells a gateway when a request cannot run: a status, a message, a parameter.

Every refusal the worker makes is a :class:`RequestError`; what vLLM raises
or answers is mapped onto one here, so the gateway gets a ``Failed`` with
the status ``vllm serve`` would have answered.
"""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request the engine cannot run; ``status`` is the HTTP status to report."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def from_error_response(response: Any) -> RequestError:
    """vLLM's ``ErrorResponse`` (its renderer's answer to a bad request) as a RequestError."""
    error = response.error
    return RequestError(int(error.code), str(error.message), error.param)


def classify_engine_error(exc: Exception) -> tuple[int, str, str | None]:
    """(HTTP status, message, parameter) for an exception out of vLLM.

    vLLM raises its client errors (and plain ValueErrors for bad input) from
    inside ``generate``; those are the client's 400s, anything else is ours.
    """
    from vllm.exceptions import VLLMClientError, VLLMValidationError

    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, VLLMValidationError):
            return 400, str(cause), cause.parameter
        if isinstance(cause, VLLMClientError | ValueError):
            return 400, str(cause), None
        cause = cause.__cause__
    return 500, f"engine error: {type(exc).__name__}: {exc}", None
