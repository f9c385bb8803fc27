"""CURVE key files: `llmgate keys generate`, loading them, and the settings that name them."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq
from zmq.auth.certs import load_certificate, load_certificates

from shared import cli, curve_keys
from shared.settings import LinkSettings, WorkerLinkSettings


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_generate_writes_a_secret_file_only_its_owner_reads(tmp_path: Path) -> None:
    public_path, secret_path = curve_keys.generate(tmp_path / "new", "worker")
    assert (public_path.name, secret_path.name) == ("worker.key", "worker.key_secret")
    assert _mode(secret_path) == 0o600
    assert _mode(public_path) == 0o644  # meant to be copied to the peers
    public, secret = curve_keys.load_keypair(secret_path)
    assert curve_keys.load_public_key(public_path) == public
    assert len(public) == len(secret) == 40
    # The secret really is the public key's: libzmq derives the one from the other.
    assert zmq.curve_public(secret) == public
    assert b"secret-key" not in public_path.read_bytes()


def test_files_are_zeromq_certificates_that_pyzmq_reads(tmp_path: Path) -> None:
    public_path, secret_path = curve_keys.generate(tmp_path, "gateway-a")
    curve_keys.generate(tmp_path, "gateway-b")
    assert load_certificate(secret_path)[1] is not None
    # A directory of them is what a worker's --curve-gateway-keys-dir holds.
    assert set(load_certificates(tmp_path)) == {
        curve_keys.load_public_key(public_path),
        curve_keys.load_public_key(tmp_path / "gateway-b.key"),
    }


def test_generate_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    _, secret_path = curve_keys.generate(tmp_path, "worker")
    old = curve_keys.load_keypair(secret_path)
    with pytest.raises(curve_keys.KeyFileError, match="--force"):
        curve_keys.generate(tmp_path, "worker")
    assert curve_keys.load_keypair(secret_path) == old
    secret_path.chmod(0o644)  # a loosened old file must not pass its mode on
    curve_keys.generate(tmp_path, "worker", force=True)
    assert curve_keys.load_keypair(secret_path) != old
    assert _mode(secret_path) == 0o600


@pytest.mark.parametrize("name", ["", "../up", ".hidden", "a/b"])
def test_generate_refuses_odd_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(curve_keys.KeyFileError):
        curve_keys.generate(tmp_path, name)


def test_the_cli_subcommand_writes_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["keys", "generate", "worker", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert str(tmp_path / "worker.key_secret") in out
    assert _mode(tmp_path / "worker.key_secret") == 0o600
    with pytest.raises(SystemExit, match="exists"):
        cli.main(["keys", "generate", "worker", "--dir", str(tmp_path)])


def test_a_public_key_file_is_not_a_keypair(tmp_path: Path) -> None:
    public_path, _ = curve_keys.generate(tmp_path, "worker")
    with pytest.raises(curve_keys.KeyFileError, match="no secret key"):
        curve_keys.load_keypair(public_path)


def test_a_missing_or_broken_key_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(curve_keys.KeyFileError, match="cannot read"):
        curve_keys.load_public_key(tmp_path / "absent.key")
    broken = tmp_path / "broken.key"
    broken.write_text('curve\n    public-key = "short"\n')
    with pytest.raises(curve_keys.KeyFileError, match="40 Z85 characters"):
        curve_keys.load_public_key(broken)


def test_no_curve_settings_mean_plaintext() -> None:
    assert curve_keys.gateway_curve(LinkSettings()) is None
    assert curve_keys.worker_curve(WorkerLinkSettings()) is None


def test_curve_settings_come_in_pairs(tmp_path: Path) -> None:
    _, secret_path = curve_keys.generate(tmp_path, "k")
    with pytest.raises(curve_keys.KeyFileError, match="go together"):
        curve_keys.gateway_curve(LinkSettings(curve_gateway_key_file=str(secret_path)))
    with pytest.raises(curve_keys.KeyFileError, match="go together"):
        curve_keys.worker_curve(WorkerLinkSettings(curve_worker_key_file=str(secret_path)))
    with pytest.raises(curve_keys.KeyFileError, match="not a directory"):
        curve_keys.worker_curve(
            WorkerLinkSettings(
                curve_worker_key_file=str(secret_path), curve_gateway_keys_dir=str(secret_path)
            )
        )


def test_settings_load_both_sides_keys(tmp_path: Path) -> None:
    worker_public, worker_secret = curve_keys.generate(tmp_path / "worker", "worker")
    _, gateway_secret = curve_keys.generate(tmp_path / "gateways", "gw")
    client = curve_keys.gateway_curve(
        LinkSettings(
            curve_gateway_key_file=str(gateway_secret),
            curve_worker_public_key_file=str(worker_public),
        )
    )
    server = curve_keys.worker_curve(
        WorkerLinkSettings(
            curve_worker_key_file=str(worker_secret),
            curve_gateway_keys_dir=str(tmp_path / "gateways"),
        )
    )
    assert client is not None and server is not None
    assert client.server_key == server.public_key
    assert server.authorized_keys() == {client.public_key}
