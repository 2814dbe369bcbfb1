"""Setting up security: `tierkv secrets init` provisions a LAN whose files start a real vault
(TLS + tokens) that a client stores into and restores from, and every `[security]` setting that
cannot take effect is refused with one line naming it.
"""

from __future__ import annotations

import os
import socket
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import pick_free_port, wait_until
from tls_certs import make_certs
from typer.testing import CliRunner

from tierkv.backends.base import BackendStats, BackendUnavailable
from tierkv.backends.vault import VaultClient
from tierkv.cli import app
from tierkv.config import ConfigError, load_config
from tierkv.wire.secrets import TOKEN_ENV

runner = CliRunner()


def _private_files(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()]


def test_secrets_init_provisions_a_tls_vault_that_an_engine_restores_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    port = pick_free_port()
    lan = tmp_path / "lan"
    args = ["secrets", "init", str(lan), "--tenant", "alice", "--tenant", "bob"]
    result = runner.invoke(app, [*args, "--tls", "127.0.0.1", "--port", str(port)])
    assert result.exit_code == 0, result.output
    files = _private_files(lan)
    assert {path.relative_to(lan).as_posix() for path in files} >= {
        "vault/tokens",
        "vault/tierkv.toml",
        "vault/vault.crt",
        "vault/vault.key",
        "alice/token",
        "alice/data_key",
        "alice/tierkv.toml",
        "alice/ca.crt",
        "ca/ca.key",
    }
    assert all(path.stat().st_mode & 0o777 == 0o600 for path in files)
    key_id, key = (lan / "alice" / "data_key").read_text().split()
    assert key_id == "1" and len(key) == 43  # 32 bytes, URL-safe base64 without padding
    assert runner.invoke(app, [*args]).exit_code == 2  # never overwrites a provisioned LAN

    # From another directory: the files a tierkv.toml names are relative to its own directory.
    command = [sys.executable, "-m", "tierkv", "vault", "--config", str(lan / "vault/tierkv.toml")]
    vault = subprocess.Popen(
        [*command, "--listen", f"127.0.0.1:{port}", "--max-bytes", "256MiB"],
        cwd="/",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        monkeypatch.chdir(tmp_path)
        cfg = load_config(Path("lan/alice/tierkv.toml"))
        assert cfg.security.data_key_file == str(lan / "alice/data_key")
        address = cfg.cluster.kv_cold[0].address
        with VaultClient.from_config(address, cfg.client, cfg.security) as engine:
            answers: list[BackendStats] = []

            def answered() -> bool:
                try:
                    answers.append(engine.stats())
                except BackendUnavailable:
                    assert vault.poll() is None
                    return False
                return True

            assert wait_until(answered, 30, interval=0.2)
            stats = answers[0]
            assert (stats.tls, stats.auth_required, stats.tenant) == (True, True, "alice")
            engine.put(b"ns", b"k" * 16, 0, b"alice's KV" * 1000)
            assert engine.flush(timeout=10) and engine.stored_puts == 1
            found = engine.promote(b"ns", [b"k" * 16], [0])
            assert bytes(found[(0, 0)]) == b"alice's KV" * 1000 and engine.transport == "bulk"
    finally:
        vault.terminate()
        output, _ = vault.communicate(timeout=30)
    assert "auth: 2 tokens, 2 tenants, TLS" in output


def test_provisioned_certificates_pass_strict_verification(tmp_path: Path) -> None:
    """Python 3.13 verifies with OpenSSL's X509_STRICT by default (redis-py's rediss:// among
    others): the certificates tierkv issues carry the key identifiers and key usage it needs,
    for the vault's side and the client's (mutual TLS)."""
    certs = make_certs(tmp_path)

    def context(purpose: ssl.Purpose, cert: Path, key: Path) -> ssl.SSLContext:
        made = ssl.create_default_context(purpose, cafile=str(certs.ca))
        made.verify_flags |= ssl.VERIFY_X509_STRICT
        made.verify_mode = ssl.CERT_REQUIRED
        made.load_cert_chain(cert, key)
        return made

    server = context(ssl.Purpose.CLIENT_AUTH, certs.server_cert, certs.server_key)
    client = context(ssl.Purpose.SERVER_AUTH, certs.client_cert, certs.client_key)
    server_end, client_end = socket.socketpair()
    accepted: list[object] = []
    side = threading.Thread(
        target=lambda: accepted.append(server.wrap_socket(server_end, server_side=True))
    )
    side.start()
    with client.wrap_socket(client_end, server_hostname="localhost") as tls:
        side.join(10)
        assert tls.version() is not None and accepted
        assert tls.getpeercert()["subjectAltName"] == (
            ("IP Address", "127.0.0.1"),
            ("IP Address", "0:0:0:0:0:0:0:1"),
            ("DNS", "localhost"),
        )


def test_secrets_init_refuses_a_bad_tenant_name(tmp_path: Path) -> None:
    result = runner.invoke(app, ["secrets", "init", str(tmp_path / "x"), "--tenant", "a/b"])
    assert result.exit_code == 2 and "--tenant 'a/b'" in result.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", [".", ".."])
def test_secrets_init_refuses_a_tenant_named_like_a_directory(tmp_path: Path, name: str) -> None:
    target = tmp_path / "lan" / "x"
    result = runner.invoke(app, ["secrets", "init", str(target), "--tenant", name])
    assert result.exit_code == 2 and f"--tenant {name!r}" in result.output
    assert not (tmp_path / "lan").exists()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_secrets_init_refuses_a_wildcard_tls_address(tmp_path: Path, host: str) -> None:
    result = runner.invoke(app, ["secrets", "init", str(tmp_path / "x"), "--tls", host])
    assert result.exit_code == 2 and f"--tls {host!r}" in result.output
    assert not (tmp_path / "x").exists()


def test_secrets_init_makes_its_directory_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        result = runner.invoke(app, ["secrets", "init", str(tmp_path / "x"), "--tenant", "a"])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    for directory in [tmp_path / "x", *(p for p in (tmp_path / "x").rglob("*") if p.is_dir())]:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


def _secret(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


TOKEN = "a-token-0123456789abcdef"


@pytest.mark.parametrize(
    ("security", "args", "named"),
    [
        ('client_ca = "ca.crt"', [], "security.client_ca needs security.tls_cert"),
        ('tls_cert = "vault.crt"', [], "security.tls_cert needs security.tls_key"),
        ('tls_key = "vault.key"', [], "security.tls_key needs security.tls_cert"),
        ('token_file = "open_tokens"', [], "security.token_file"),
        ('token_file = "tokens"', ["--insecure"], "--insecure together with tokens"),
    ],
    ids=[
        "client_ca-without-cert",
        "cert-without-key",
        "key-without-cert",
        "open-token-file",
        "insecure-with-tokens",
    ],
)
def test_a_vault_refuses_settings_that_cannot_take_effect(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    security: str,
    args: list[str],
    named: str,
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _secret(tmp_path / "tokens", f"{TOKEN}\n")
    _secret(tmp_path / "open_tokens", f"{TOKEN}\n", 0o644)
    (tmp_path / "tierkv.toml").write_text(f"[security]\n{security}\n")
    listen = f"127.0.0.1:{pick_free_port()}"
    result = runner.invoke(app, ["vault", "--config", "tierkv.toml", "--listen", listen, *args])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], result.output
    assert "listening" not in result.output


@pytest.mark.parametrize("setting", ["token_file", "data_key_file", "tls_key"])
def test_an_engine_refuses_a_secret_file_others_can_read(tmp_path: Path, setting: str) -> None:
    from tierkv.config import ClientConfig, SecurityConfig

    secret = _secret(tmp_path / "secret", f"{TOKEN}\n", 0o640)
    paths = {setting: str(secret)}
    if setting == "tls_key":
        paths["tls_cert"] = str(_secret(tmp_path / "cert", "unused"))
    with pytest.raises(ConfigError, match=f"security.{setting} .*open to group or others"):
        VaultClient.from_config("127.0.0.1:1", ClientConfig(), SecurityConfig(**paths))
    secret.chmod(0o600)
    if setting != "tls_key":  # then nothing to refuse (the client is never started here)
        VaultClient.from_config("127.0.0.1:1", ClientConfig(), SecurityConfig(**paths)).close()


def test_an_engine_whose_vaults_are_all_redis_refuses_a_data_key_file_others_can_read(
    tmp_path: Path,
) -> None:
    """The check runs for every tier, whatever its backends: no vault client is built here."""
    from tests.redis_servers import start_redis
    from tierkv.seal import new_data_key_line
    from tierkv.tier import ColdTier

    server = start_redis(tmp_path)
    try:
        data_key = tmp_path / "data.key"
        data_key.write_text(new_data_key_line(1))
        data_key.chmod(0o644)
        config = tmp_path / "tierkv.toml"
        config.write_text(
            f'[cluster]\nkv_cold = "redis://{server.address}"\n'
            f'[security]\ndata_key_file = "{data_key}"\n'
        )
        with pytest.raises(ConfigError, match=r"security\.data_key_file .*open to group or others"):
            ColdTier.from_config(load_config(config), warm_dtypes=())
        result = runner.invoke(app, ["status", "--config", str(config)])
        assert result.exit_code == 2 and "security.data_key_file" in result.output
        data_key.chmod(0o600)
        ColdTier.from_config(load_config(config), warm_dtypes=()).close()
    finally:
        server.stop()
