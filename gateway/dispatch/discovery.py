"""Where the workers are: ``--workers`` addresses, with host names resolved again and again.

``tcp://host:port`` entries whose host is a name are resolved every
``--resolve-interval`` seconds, one worker per IP address, so the DNS name of
a Kubernetes headless Service yields one worker per pod as pods come and go.
IP addresses and ``ipc://`` addresses are used as they are.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


class Discovery:
    """Resolves ``--workers`` and hands the set of addresses to ``sync`` each time."""

    def __init__(self, spec: str, interval: float, sync: Callable[[set[str]], None]) -> None:
        self.specs = parse_addresses(spec)
        self.interval = interval
        self._sync = sync

    @property
    def changes(self) -> bool:
        """Whether any address is a name that may resolve differently later."""
        return any(_needs_resolution(spec) for spec in self.specs)

    async def resolve(self) -> None:
        addresses: set[str] = set()
        for spec in self.specs:
            addresses.update(await resolve(spec))
        self._sync(addresses)

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.resolve()
            except Exception:
                log.exception("resolving worker addresses failed")


def normalize_address(address: str) -> str:
    """A bare ``host:port`` as the ZeroMQ address ``tcp://host:port``."""
    return address if "://" in address else f"tcp://{address}"


def parse_addresses(spec: str) -> list[str]:
    """``tcp://a:1,tcp://b:2`` (or bare ``host:port``) as a list of ZMQ addresses."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        out.append(normalize_address(part))
    if not out:
        raise ValueError("no worker addresses given")
    return out


def _needs_resolution(address: str) -> bool:
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname:
        return False
    try:
        ipaddress.ip_address(parts.hostname)
    except ValueError:
        return True
    return False


async def resolve(address: str) -> list[str]:
    """A ``tcp://name:port`` address as one address per IPv4 (else IPv6) address of name.

    Other forms (IP addresses, ``ipc://``) are returned as they are. A name
    that does not resolve yet yields nothing: its workers join when it does.
    """
    if not _needs_resolution(address):
        return [address]
    parts = urlsplit(address)
    host, port = parts.hostname or "", parts.port
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("cannot resolve %s: %s", host, exc)
        return []
    v4 = sorted({str(info[4][0]) for info in infos if info[0] == socket.AF_INET})
    if v4:
        return [f"tcp://{ip}:{port}" for ip in v4]
    v6 = sorted({str(info[4][0]) for info in infos if info[0] == socket.AF_INET6})
    return [f"tcp://[{ip}]:{port}" for ip in v6]
