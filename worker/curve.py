"""Who may talk to the worker: the ZAP authenticator that lets in the gateways' CURVE keys.

A CURVE socket with no ZAP handler lets every client in, so the
authenticator starts before the worker's socket binds (``worker.server``).
The keys themselves (files, ``llmgate keys generate``) are ``shared.curve_keys``.
"""

from __future__ import annotations

import logging
import time

import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from shared import curve_keys

log = logging.getLogger(__name__)


class GatewayAuthenticator(AsyncioAuthenticator):
    """ZAP handler that lets in the gateways whose public keys are in a directory.

    The directory is read on every handshake (handshakes are rare: one per
    gateway connection), so adding or removing a key file takes effect without
    a restart. Its ZAP socket is inproc, written by libzmq only.
    """

    def __init__(self, ctx: zmq.asyncio.Context, curve: curve_keys.CurveServer) -> None:
        super().__init__(ctx)
        self._curve = curve
        self._peer = ""
        self._warned: dict[bytes, float] = {}

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # Frame 3 of a ZAP request is the client's IP address, for the log.
        self._peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, _domain: str, client_key: bytes) -> bool:
        """True if ``client_key`` (Z85) is an authorized gateway's public key."""
        try:
            allowed = client_key in self._curve.authorized_keys()
        except (OSError, ValueError) as exc:
            log.error("cannot read --curve-gateway-keys-dir, refusing everyone: %s", exc)
            return False
        if not allowed and first_in_a_minute(self._warned, client_key):
            log.warning(
                "ZAP denied a client from %s with unknown CURVE key %s (not in %s)",
                self._peer,
                client_key.decode(errors="replace"),
                self._curve.authorized_dir,
            )
        return allowed


def start_authenticator(
    ctx: zmq.asyncio.Context, curve: curve_keys.CurveServer
) -> GatewayAuthenticator:
    """Start ZAP for ``ctx``; call inside the running loop, before a CURVE socket binds."""
    authenticator = GatewayAuthenticator(ctx, curve)
    authenticator.start()
    authenticator.configure_curve_callback(credentials_provider=authenticator)
    return authenticator


def first_in_a_minute(last: dict[bytes, float], what: bytes) -> bool:
    """True at most once a minute per ``what``: a rejected peer retries every few seconds."""
    now = time.monotonic()
    if now - last.get(what, float("-inf")) < 60.0:
        return False
    if len(last) > 1024:  # many distinct keys: forget, rather than grow
        last.clear()
    last[what] = now
    return True
