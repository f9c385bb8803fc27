"""The gateway's errors, and their one mapping onto OpenAI's error JSON.

Every error a client can see is a :class:`GatewayError`, its body OpenAI's
``{"error": {"message", "type", "param", "code"}}``:

    GatewayError                     (500 api_error)
    ├── BadRequest                   (400 invalid_request_error)
    │   └── PayloadTooLarge          (413 invalid_request_error)
    ├── Unauthorized                 (401 invalid_request_error, code invalid_api_key)
    ├── Forbidden                    (403 invalid_request_error, code model_not_allowed)
    │   └── AdminOnly                (403 invalid_request_error, no code: /metrics)
    ├── NotFound                     (404 invalid_request_error: no such route)
    │   └── ModelNotFound            (404, code model_not_found: never declared nor served)
    ├── Overloaded                   (429 rate_limit_exceeded, Retry-After)
    │   └── RateLimited              (429, code rate_limit_exceeded: a key's limit)
    │       └── OverBudget           (429, code insufficient_quota: a key's budget)
    ├── NoWorker                     (503 service_unavailable, Retry-After)
    │   ├── ModelNotReady            (503, code model_not_ready: declared or served, none now)
    │   └── StateUnavailable         (503, code state_store_unavailable)
    ├── UpstreamFailed               (502 api_error: a worker died or broke mid-request)
    └── Timeout                      (504 timeout)

A worker's ``Failed`` message becomes the class for its status (:func:`from_status`).
"""

from __future__ import annotations

from typing import Any, ClassVar

# Seconds a 503 for want of a worker tells the client to wait (Retry-After):
# a worker that is starting takes tens of seconds, a restart about as long.
NO_WORKER_RETRY_AFTER = 5


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "api_error"
    code: ClassVar[str | None] = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def headers(self) -> dict[str, str]:
        return {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    status = 413


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class Forbidden(GatewayError):
    """The request's API key may not use the model it asked for (its ``models``)."""

    status = 403
    type = "invalid_request_error"
    code: ClassVar[str | None] = "model_not_allowed"


class AdminOnly(Forbidden):
    """A route for operators (``/metrics``) asked for with a key that is not ``admin``;
    no code, as OpenAI's own answer for a key without the permission has none."""

    code = None


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


class ModelNotFound(NotFound):
    code = "model_not_found"

    @classmethod
    def for_model(cls, model: str) -> ModelNotFound:
        return cls(f"The model `{model}` does not exist.", "model")


class Overloaded(GatewayError):
    status = 429
    type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class RateLimited(Overloaded):
    """The request's API key is over one of its limits (``gateway.tenants``).

    ``retry_after`` None: the request alone is over the key's tokens a
    minute, and waiting does not help (no ``Retry-After``)."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int | None, limit: str = "requests") -> None:
        super().__init__(message, retry_after or 1)
        self.waiting_helps = retry_after is not None
        self.limit = limit

    def body(self) -> dict[str, Any]:
        body = super().body()
        # As OpenAI types its own: which limit, "requests" or "tokens".
        body["error"]["type"] = self.limit
        return body

    def headers(self) -> dict[str, str]:
        return super().headers() if self.waiting_helps else {}


class OverBudget(RateLimited):
    """The request's API key has spent its budget for the day or the month
    (``gateway.tenants.budgets``): OpenAI's answer to a quota used up."""

    code = "insufficient_quota"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, retry_after, "insufficient_quota")


class NoWorker(GatewayError):
    status = 503
    type = "service_unavailable"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        retry_after: int | None = NO_WORKER_RETRY_AFTER,
    ) -> None:
        super().__init__(message, param)
        # Seconds a client may wait before trying again; None: no Retry-After
        # (a 503 that waiting does not cure).
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


class ModelNotReady(NoWorker):
    """A declared model no worker serves yet (its pool is starting) or now (down)."""

    code = "model_not_ready"

    @classmethod
    def for_model(cls, model: str, served_before: bool) -> ModelNotReady:
        if served_before:
            why = "no worker serves it now (its workers are down or restarting)"
        else:
            why = "it is starting, and no worker serves it yet"
        return cls(f"The model `{model}` is not ready: {why}; try again shortly.", "model")


class StateUnavailable(NoWorker):
    """The state store (files, batches, stored responses) does not answer."""

    code = "state_store_unavailable"


class UpstreamFailed(GatewayError):
    status = 502


class Timeout(GatewayError):
    status = 504
    type = "timeout"


_BY_STATUS: dict[int, type[GatewayError]] = {
    400: BadRequest,
    404: ModelNotFound,
    413: PayloadTooLarge,
    502: UpstreamFailed,
    503: NoWorker,
    504: Timeout,
}


def from_status(status: int, message: str, param: str | None = None) -> GatewayError:
    """The error for a worker's ``Failed(status, ...)``."""
    if status == 429:
        return Overloaded(message)
    if status == 404 and param != "model":
        return NotFound(message, param)
    cls = _BY_STATUS.get(status)
    if cls is None:
        cls = BadRequest if 400 <= status < 500 else GatewayError
    return cls(message, param)
