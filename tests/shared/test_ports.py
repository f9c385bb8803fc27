"""shared/ports.py: free ports outside the kernel's ephemeral range, never handed out twice."""

from __future__ import annotations

import socket

import pytest

from shared import ports


def test_ports_are_below_the_ephemeral_range_free_and_distinct() -> None:
    top = ports.ephemeral_start()
    bases = [ports.free_port_range(4) for _ in range(50)]
    for base in bases:
        assert ports.LOWEST <= base and base + 4 <= top
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", base + 3))  # free: nobody holds it
    taken = [p for base in bases for p in range(base, base + 4)]
    assert len(taken) == len(set(taken))  # no port handed out twice


def test_a_port_held_by_another_program_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST", port)
        monkeypatch.setattr(ports, "ephemeral_start", lambda: port + 200)
        assert all(ports.free_port() != port for _ in range(100))


def test_an_unusual_ephemeral_range_falls_back_to_the_kernels_pick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "ephemeral_start", lambda: 1024)
    base = ports.free_port_range(2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", base + 1))
