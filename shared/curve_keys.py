"""CURVE keys for the gateway-worker links, and ``llmgate keys generate``.

Key files are ZeroMQ certificates in czmq's text format, the one pyzmq's
``zmq.auth`` reads: ``NAME.key`` holds a public key, ``NAME.key_secret`` the
same public key and its secret key. Keys are Z85 text (40 characters).

Who holds what:

* every worker has the workers' key pair (``--curve-worker-key-file``) and a
  directory of the public keys of the gateways it accepts
  (``--curve-gateway-keys-dir``);
* every gateway has its own key pair (``--curve-gateway-key-file``) and the
  workers' public key (``--curve-worker-public-key-file``).

A worker with a key is a CURVE server: traffic is encrypted, and a client
whose public key is not in the directory fails the handshake (ZAP), as does a
plaintext one. Both settings of a side are set together or not at all.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.certs import load_certificate, load_certificates

from shared import api_keys
from shared.settings import LinkSettings, WorkerLinkSettings

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


class KeyFileError(ValueError):
    """A key setting is incomplete, or a key file is missing or malformed."""


@dataclass(frozen=True)
class CurveClient:
    """What a gateway's DEALER needs to reach CURVE workers."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE client; call before it connects."""
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_key)


@dataclass(frozen=True)
class CurveServer:
    """What a worker's ROUTER needs to be a CURVE server, and whom it lets in."""

    public_key: bytes
    secret_key: bytes
    authorized_dir: Path

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server; call before it binds (and start ZAP first)."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)

    def authorized_keys(self) -> set[bytes]:
        """The Z85 public keys in the directory now (it is read on every handshake)."""
        return set(load_certificates(self.authorized_dir))


# Socket-monitor events of a handshake that failed.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def handshake_failure(event: int, value: int) -> str:
    """Words for a failed-handshake monitor event, for the logs of either side."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the worker's authenticator refused this gateway's CURVE key (ZAP {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "one side uses CURVE and the other does not"
        return f"ZMTP protocol error {value:#x} (wrong CURVE keys?)"
    return f"no detail (errno {value}): CURVE on one side only, wrong keys, or a dropped link"


def load_keypair(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a ``NAME.key_secret`` file."""
    public, secret = _load(path)
    if secret is None:
        raise KeyFileError(f"{path} holds no secret key: give the NAME{SECRET_SUFFIX} file")
    return public, secret


def load_public_key(path: str | Path) -> bytes:
    """The Z85 public key from a ``NAME.key`` (or ``NAME.key_secret``) file."""
    return _load(path)[0]


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read CURVE key file {path}: {exc}") from exc
    for key in (public, secret):
        if key is not None and len(key) != 40:
            raise KeyFileError(f"{path}: a CURVE key is 40 Z85 characters, got {len(key)}")
    return public, secret


def gateway_curve(settings: LinkSettings) -> CurveClient | None:
    """The gateway's CURVE client keys, or None for plaintext links."""
    own, server = settings.curve_gateway_key_file, settings.curve_worker_public_key_file
    if not own and not server:
        return None
    if not (own and server):
        raise KeyFileError(
            "--curve-gateway-key-file and --curve-worker-public-key-file go together"
        )
    public, secret = load_keypair(own)
    return CurveClient(public, secret, load_public_key(server))


def worker_curve(settings: WorkerLinkSettings) -> CurveServer | None:
    """The worker's CURVE server keys, or None for a plaintext socket."""
    own, directory = settings.curve_worker_key_file, settings.curve_gateway_keys_dir
    if not own and not directory:
        return None
    if not (own and directory):
        raise KeyFileError("--curve-worker-key-file and --curve-gateway-keys-dir go together")
    if not Path(directory).is_dir():
        raise KeyFileError(f"--curve-gateway-keys-dir {directory} is not a directory")
    public, secret = load_keypair(own)
    return CurveServer(public, secret, Path(directory))


def generate(directory: str | Path, name: str, force: bool = False) -> tuple[Path, Path]:
    """Write a new key pair as ``NAME.key`` and ``NAME.key_secret``; return their paths.

    The secret file is created with mode 0600 (never wider, even for a
    moment); the public one 0644, since it is meant to be copied to peers.
    """
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"not a key name: {name!r}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    public_path = folder / f"{name}{PUBLIC_SUFFIX}"
    secret_path = folder / f"{name}{SECRET_SUFFIX}"
    if not force:
        for path in (public_path, secret_path):
            if path.exists():
                raise KeyFileError(f"{path} exists; pass --force to replace it")
    _write(secret_path, _certificate(public, secret), 0o600)
    _write(public_path, _certificate(public, None), 0o644)
    return public_path, secret_path


def _certificate(public: bytes, secret: bytes | None) -> str:
    lines = [
        "#   ZeroMQ CURVE " + ("**Secret** Certificate" if secret else "Public Certificate"),
        "#   written by `llmgate keys generate`",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret is not None:
        lines.insert(2, "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.")
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int) -> None:
    # Replace, not truncate: an old file's wider mode must not carry over.
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(text)
    os.chmod(path, mode)  # the umask may have narrowed the public file's mode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgate keys",
        description="API keys with names and limits (add, list, revoke: shared.api_keys), "
        "and CURVE keys for encrypted gateway-worker links (generate).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    generate_cmd = commands.add_parser(
        "generate", help="write NAME.key (public) and NAME.key_secret (secret, mode 0600)"
    )
    generate_cmd.add_argument("name", help="key name, e.g. worker or gateway-a")
    generate_cmd.add_argument(
        "--dir", default=".", help="directory to write into (created if missing) [default .]"
    )
    generate_cmd.add_argument("--force", action="store_true", help="replace existing files")
    api_keys.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if api_keys.run(args):
        return
    try:
        public_path, secret_path = generate(args.dir, args.name, args.force)
    except (KeyFileError, OSError) as exc:
        sys.exit(f"llmgate keys: {exc}")
    print(f"public key: {public_path}\nsecret key: {secret_path}")


if __name__ == "__main__":
    main()
