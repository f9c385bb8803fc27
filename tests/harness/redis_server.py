"""A real Redis server for the tests: Debian's ``redis-server`` (``make test`` installs it).

Started on a free loopback port with no persistence, ready once it logs
that it accepts connections; stopped (and startable again on the same
port) by the test that needs Redis to go away.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from shared.ports import free_port

READY_LINE = "Ready to accept connections"


class RedisServer:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.log_path = directory / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is missing: `make test` installs Debian's redis-server"
        self.log_path.write_bytes(b"")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        argv += ["--logfile", str(self.log_path)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while READY_LINE not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.log_path.read_text(errors="replace")
                raise RuntimeError(f"redis-server did not start:\n{log}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None
