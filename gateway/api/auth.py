"""API keys: ``Authorization: Bearer KEY`` on every route but the probes.

A pure ASGI middleware rather than a FastAPI dependency: it runs before
routing and before a byte of the body is read, covers every route (those of
future routers and unknown paths too), and costs one SHA-256 and a few
constant-time compares per request. With no keys configured it is not
installed at all.

The presented key is hashed before comparing, so every comparison is of two
32-byte digests: neither a key's length nor which key matched shows in the
timing. Keys are never logged and never echoed in a response.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import errors
from gateway.api.request_ids import with_request_id
from gateway.routes import render
from shared import routes
from shared.settings import GatewaySettings

_MISSING = errors.Unauthorized(
    "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
    "(Authorization: Bearer YOUR_KEY)."
)
_WRONG = errors.Unauthorized("Incorrect API key provided.")


def load_api_keys(settings: GatewaySettings) -> list[str]:
    """Every configured key: ``--api-keys`` and the lines of ``--api-keys-file``.

    A keys file that holds no key is an error, not "no authentication": an
    empty secret mount must not open the gateway.
    """
    keys = [key.strip() for key in settings.api_keys.split(",") if key.strip()]
    if settings.api_keys_file:
        path = Path(settings.api_keys_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read --api-keys-file {path}: {exc}") from exc
        from_file = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        from_file = [key for key in from_file if key]
        if not from_file:
            raise ValueError(f"--api-keys-file {path} holds no key")
        keys += from_file
    for key in keys:
        if not key.isascii() or not key.isprintable() or " " in key:
            # Said without the key itself: this message may reach a log.
            raise ValueError("an API key must be printable ASCII without spaces")
    return keys


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: list[str], protect_metrics: bool = False) -> None:
        if not keys:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.app = app
        self._digests = tuple(_digest(key.encode("ascii")) for key in keys)
        # Load balancers and Kubernetes probes carry no key (the route table's `key`).
        self._open = routes.open_paths(protect_metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        error = self._check(scope["headers"])
        if error is None:
            await self.app(scope, receive, send)
            return
        # In the route's dialect: TGI's client reads TGI's error body.
        await with_request_id(render(error, scope["path"]), scope)(scope, receive, send)

    def _check(self, headers: list[tuple[bytes, bytes]]) -> errors.Unauthorized | None:
        """None if the request carries a configured key, else the error to send."""
        token = _bearer_token(headers)
        if token is None:
            return _MISSING
        presented = _digest(token)
        matched = False
        for digest in self._digests:  # no early exit: the time is the same for every key
            matched |= hmac.compare_digest(presented, digest)
        return None if matched else _WRONG


def _bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first ``Authorization: Bearer`` header, or None."""
    for name, value in headers:
        if name == b"authorization":  # ASGI servers lower-case header names
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            if scheme.lower() != b"bearer" or not token:
                return None
            return token
    return None
