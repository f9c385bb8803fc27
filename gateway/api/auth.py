"""API keys: ``Authorization: Bearer KEY`` on every route but the probes, and who the key is.

:class:`ApiKeyMiddleware` is pure ASGI, not a FastAPI dependency, so it runs
before routing and before a byte of the body is read, and covers every path,
unknown ones too; it is installed only when keys are configured. A key that
matches puts its entry (``shared.api_keys.KeyEntry``) in the request's context
(``gateway.context``): enforcing its limits, models and priority is
``gateway.tenants``'s and the routes' job. Admin paths (``/metrics``) are a 403
for any other key. What a request makes is owned by its key's id, never its
name (``RequestContext.owner``). Keys are never logged or echoed.
:class:`KeyRing` re-reads ``--api-keys-file`` when it changes; a file that no
longer loads keeps the keys it had.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import errors
from gateway.api.request_ids import with_request_id
from gateway.context import context_of
from gateway.endpoints import render
from shared import api_keys, routes
from shared.api_keys import KeyEntry
from shared.settings import TenantSettings

log = logging.getLogger(__name__)

# How often --api-keys-file is looked at (one stat): a key added or revoked
# counts within that long in every process and replica that mounts the file.
RELOAD_SECONDS = 1.0

_MISSING = errors.Unauthorized(
    "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
    "(Authorization: Bearer YOUR_KEY)."
)
_WRONG = errors.Unauthorized("Incorrect API key provided.")
_NOT_ADMIN = errors.AdminOnly(
    "You have insufficient permissions for this operation: it needs an admin key "
    "(`admin: true` in the keys file)."
)


def load_api_keys(settings: TenantSettings) -> list[KeyEntry]:
    """Every configured key: ``--api-keys`` and those of ``--api-keys-file``
    (ValueError, never quoting a key, for a file that cannot be used, or for a
    key, name or id given twice: one would own, or show as, the other's)."""
    flagged = [
        api_keys.plain_entry(key.strip()) for key in settings.api_keys.split(",") if key.strip()
    ]
    api_keys.check_unique(flagged, "--api-keys: ", "given twice")
    entries = list(flagged)
    if settings.api_keys_file:
        entries += api_keys.load(settings.api_keys_file)  # unique within the file
    api_keys.check_unique(entries, "", "in both --api-keys and --api-keys-file")
    return entries


class KeyRing:
    """The configured keys by digest, re-read from ``--api-keys-file`` when it changes."""

    def __init__(self, settings: TenantSettings) -> None:
        self.settings = settings
        self.path = Path(settings.api_keys_file) if settings.api_keys_file else None
        self._stamp = self._stat()
        self._checked = time.monotonic()
        self._set(load_api_keys(settings))

    @classmethod
    def of(cls, keys: list[str]) -> KeyRing:
        return cls(TenantSettings(api_keys=",".join(keys)))

    def __len__(self) -> int:
        return len(self._entries)

    def _set(self, entries: list[KeyEntry]) -> None:
        self._entries = [(bytes.fromhex(entry.key_sha256), entry) for entry in entries]

    def _stat(self) -> tuple[float, int, int] | None:
        if self.path is None:
            return None
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return (stat.st_mtime, stat.st_ino, stat.st_size)

    def refresh(self) -> None:
        """Re-read the file if it changed (at most every ``RELOAD_SECONDS``)."""
        now = time.monotonic()
        if self.path is None or now - self._checked < RELOAD_SECONDS:
            return
        self._checked = now
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            entries = load_api_keys(self.settings)
        except ValueError as exc:
            log.error("API keys: keeping the keys loaded before: %s", exc)
            return
        self._set(entries)
        log.info("API keys: re-read %s: %d keys", self.path, len(entries))

    def entries(self) -> list[KeyEntry]:
        """Every configured key, as the file says now."""
        self.refresh()
        return [entry for _, entry in self._entries]

    def with_id(self, key_id: str) -> KeyEntry | None:
        """The key whose id is ``key_id``, as the file says now (None if it is gone:
        revoked, or its name given to a new secret)."""
        self.refresh()
        return next((entry for _, entry in self._entries if entry.id == key_id), None)

    def match(self, token: bytes) -> KeyEntry | None:
        # Hashed first, so every comparison is of two 32-byte digests: neither
        # a key's length nor which key matched shows in the timing.
        presented = _digest(token)
        found = None
        for digest, entry in self._entries:  # no early exit: the same time for every key
            if hmac.compare_digest(presented, digest):
                found = entry
        return found


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: KeyRing | list[str]) -> None:
        ring = keys if isinstance(keys, KeyRing) else KeyRing.of(keys)
        if not len(ring):
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.app = app
        self.ring = ring
        # Load balancers and Kubernetes probes carry no key; /metrics shows
        # every key's usage, so operators only (the route table's `key`).
        self._open = routes.open_paths()
        self._admin = routes.admin_paths()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        self.ring.refresh()
        token = _bearer_token(scope["headers"])
        entry = None if token is None else self.ring.match(token)
        if entry is not None and (entry.admin or scope["path"] not in self._admin):
            context_of(scope).key = entry
            await self.app(scope, receive, send)
            return
        error: errors.GatewayError = _NOT_ADMIN
        if entry is None:
            error = _MISSING if token is None else _WRONG
        # In the route's dialect: TGI's client reads TGI's error body.
        await with_request_id(render(error, scope["path"]), scope)(scope, receive, send)


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
