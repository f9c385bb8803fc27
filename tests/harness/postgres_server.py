"""A real PostgreSQL server for the tests: Debian's ``postgresql`` (``make test`` installs it).

The server binaries (``initdb``, ``postgres``) of the newest version under
``/usr/lib/postgresql/*/bin/`` run a throwaway cluster: trust authentication,
fsync off, on a free loopback port. ``postgres`` refuses to run as root, so
under root it runs as Debian's ``postgres`` system user, in a cluster
directory that user owns. That directory is a fresh one under the system's
temporary directory, not under ``directory``: pytest keeps its temporary
directories in a root-only ``/tmp/pytest-of-root``, which ``postgres``
cannot enter. The server's log, which the test process writes, stays in
``directory`` (a failed test's report shows it, like every ``*.log`` there).

Each test takes a fresh empty database from ``create_database``; a test of an
outage ``stop``s the server and ``start``s it again on the same port.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from shared.ports import free_port

READY_LINE = "database system is ready to accept connections"
SERVER_ROOT = Path("/usr/lib/postgresql")
# The user Debian's postgresql-common creates; the server runs as it under root.
SYSTEM_USER = "postgres"
SUPERUSER = "postgres"


def server_binaries() -> Path:
    """The bin directory of the newest PostgreSQL under /usr/lib/postgresql."""
    found = [p.parent for p in SERVER_ROOT.glob("*/bin/postgres")]
    assert found, (
        f"no PostgreSQL server under {SERVER_ROOT}: `make test` installs Debian's postgresql"
    )

    def version(bindir: Path) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", bindir.parent.name))

    return max(found, key=version)


class PostgresServer:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.log_path = directory / "postgres.log"
        self.bindir = server_binaries()
        # The cluster (data and unix-socket directories), made at the first start.
        self.cluster_dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/postgres"

    def database_url(self, name: str) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{name}"

    def start(self, timeout: float = 120) -> None:
        """Start (making the cluster the first time); return once it accepts connections."""
        if self.cluster_dir is None:
            self.cluster_dir = self._init_cluster()
        since = self.log_path.stat().st_size
        argv = [str(self.bindir / "postgres"), "-D", str(self.cluster_dir / "data")]
        argv += ["-h", "127.0.0.1", "-p", str(self.port), "-k", str(self.cluster_dir / "socket")]
        # A throwaway cluster: durability costs time and buys nothing here.
        argv += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, **self._run_as(self.cluster_dir)
            )
        deadline = time.monotonic() + timeout
        while READY_LINE not in self._log(since):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"postgres did not start within {timeout}s:\n{self._log(since)}")
            time.sleep(0.1)

    def stop(self, timeout: float = 60) -> None:
        """PostgreSQL's fast shutdown (SIGINT): sessions are cut, the cluster is kept."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # immediate: the next start recovers from the WAL
                self.proc.wait()
        self.proc = None

    def remove(self) -> None:
        """Stop, and delete the cluster (the log stays in ``directory``)."""
        self.stop()
        if self.cluster_dir is not None:
            shutil.rmtree(self.cluster_dir, ignore_errors=True)
            self.cluster_dir = None

    def create_database(self, name: str) -> str:
        """A new empty database; its URL."""
        with psycopg.connect(self.url, autocommit=True) as connection:
            connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.database_url(name)

    def _init_cluster(self) -> Path:
        cluster = Path(tempfile.mkdtemp(prefix="llmgate-postgres-"))
        for sub in ("data", "socket"):
            (cluster / sub).mkdir(mode=0o700)
        if os.geteuid() == 0:
            user = pwd.getpwnam(SYSTEM_USER)
            for path in (cluster, cluster / "data", cluster / "socket"):
                os.chown(path, user.pw_uid, user.pw_gid)
        self.log_path.write_bytes(b"")
        argv = [str(self.bindir / "initdb"), "-D", str(cluster / "data"), "-U", SUPERUSER]
        argv += ["--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"]
        with self.log_path.open("ab") as log:
            done = subprocess.run(
                argv, stdout=log, stderr=subprocess.STDOUT, timeout=300, **self._run_as(cluster)
            )
        if done.returncode != 0:
            shutil.rmtree(cluster, ignore_errors=True)
            raise RuntimeError(f"initdb failed ({done.returncode}):\n{self._log(0)}")
        return cluster

    @staticmethod
    def _run_as(cluster: Path) -> dict[str, Any]:
        """Popen's arguments for a server binary: in the cluster's directory (initdb
        fails where its user cannot read the current one), with English messages
        (the ready line is matched), as the postgres user under root."""
        options: dict[str, Any] = {"cwd": cluster, "env": {**os.environ, "LC_ALL": "C"}}
        if os.geteuid() == 0:
            user = pwd.getpwnam(SYSTEM_USER)
            options |= {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        return options

    def _log(self, since: int) -> str:
        with self.log_path.open("rb") as log:
            log.seek(since)
            return log.read().decode(errors="replace")
