"""Free TCP ports for servers we start ourselves (tests, benchmarks, ``llmgate batch``).

A port the kernel hands out with ``bind(port 0)`` lies in Linux's ephemeral
range (``net.ipv4.ip_local_port_range``, 32768-60999 by default), the range
from which every outgoing connection's local end and every other program's
"any free port" are drawn too. Between our check and the server's own bind,
any of those may take it. Worse, a client dialing such a port while nothing
listens there may get that very port as its own end and connect to itself
(TCP self-connect): a CI run failed so, the gateway's link to a restarting
worker holding that worker's port and hearing its own pings. Ports here are
drawn from below that range, where only programs that name a port bind, and
never handed out twice by one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Drawn from [LOWEST, the ephemeral range's start): registered ports that
# nothing on a test or benchmark machine is expected to hold.
LOWEST = 20_000
_DEFAULT_EPHEMERAL_START = 32_768
_handed_out: set[int] = set()


def ephemeral_start() -> int:
    """Where the kernel's ephemeral port range starts (32768 where unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_START


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_range(count: int = 1) -> int:
    """A base port such that base .. base+count-1 are free now, outside the ephemeral range."""
    top = ephemeral_start()
    if top - LOWEST < 100 * count:  # an unusual range: the kernel's own pick, as before
        return _kernel_pick(count)
    rng = random.SystemRandom()
    for _ in range(500):
        base = rng.randrange(LOWEST, top - count + 1)
        ports = range(base, base + count)
        if _handed_out.isdisjoint(ports) and all(_bindable(p) for p in ports):
            _handed_out.update(ports)
            return base
    raise RuntimeError(f"no {count} free ports in a row between {LOWEST} and {top}")


def free_port() -> int:
    return free_port_range(1)


def _kernel_pick(count: int) -> int:
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = int(sock.getsockname()[1])
        if base + count <= 65_535 and all(_bindable(base + i) for i in range(1, count)):
            return base
    raise RuntimeError("no free port range")
