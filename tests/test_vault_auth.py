"""Tokens, tenants, TLS and the unsafe-default refusal, against real vaults on loopback.

No token, a wrong token or another tenant's token gets nothing on either port (and never a
payload); the right token works; several tenants never see each other's blocks; TLS and mutual
TLS carry both ports with certificates generated here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import key
from tls_certs import make_certs
from typer.testing import CliRunner

from tierkv.backends.security import proving_channel
from tierkv.backends.vault import VaultClient, VaultRefused
from tierkv.checksum import block_checksum
from tierkv.cli import app
from tierkv.config import ConfigError, SecurityConfig
from tierkv.seal import new_data_key_line
from tierkv.vault.auth import Tokens
from tierkv.vault.server import serve
from tierkv.wire._pb import vault_pb2, vault_pb2_grpc
from tierkv.wire.framing import AUTH, CHALLENGE, HEADER, MAGIC, PROMOTE, PROMOTE_REPLY, WELCOME
from tierkv.wire.messages import encode_bulk
from tierkv.wire.proofs import proof
from tierkv.wire.secrets import TOKEN_ENV, read_token_file

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef00"
NS = b"shared-namespace"
runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture
def tenants_vault(vault_factory: Callable[..., Any], tmp_path: Path) -> Any:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# two tenants\nalice {ALICE}\nbob {BOB}\n")
    tokens.chmod(0o600)
    config = f'[security]\ntoken_file = "{tokens}"\n'
    handle = vault_factory(subprocess=True, config=config, token=ALICE)
    with VaultClient(handle.address, token=ALICE) as alice:
        handle.bulk_port = alice.bulk_path()[0]
        for i in range(4):
            alice.put(NS, key(i), 0, b"alice's KV %d" % i)
        assert alice.flush(timeout=10) and alice.stored_puts == 4
        assert alice.transport == "bulk"
    return handle


def _raw_bulk(port: int) -> tuple[socket.socket, vault_pb2.BulkChallenge]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    _, kind, index_len, _ = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
    assert kind == CHALLENGE
    return sock, vault_pb2.BulkChallenge.FromString(sock.recv(index_len, socket.MSG_WAITALL))


def _read_frame(sock: socket.socket) -> tuple[int, bytes, bytes] | None:
    """(kind, index, data) of the next frame; None when the vault closed the connection."""
    try:
        head = sock.recv(HEADER.size, socket.MSG_WAITALL)
        if len(head) < HEADER.size:
            return None
        _, kind, index_len, data_len = HEADER.unpack(head)
        index = sock.recv(index_len, socket.MSG_WAITALL) if index_len else b""
        data = sock.recv(data_len, socket.MSG_WAITALL) if data_len else b""
    except (ConnectionResetError, TimeoutError):
        return None
    return kind, index, data


def _bulk_promote_as(port: int, answer: Callable[[bytes], bytes]) -> list[tuple[int, bytes]]:
    """(kind, index) of the frames the vault sends a raw bulk peer that answers the challenge
    with `answer(nonce)` and then asks for alice's blocks; no frame may carry a payload."""
    sock, challenge = _raw_bulk(port)
    frames = []
    with sock:
        assert challenge.auth_required
        auth = vault_pb2.BulkAuth(proof=answer(challenge.nonce)).SerializeToString()
        request = vault_pb2.PromoteRequest(namespace=NS, keys=[key(0), key(1)], parts=[0])
        raw = request.SerializeToString()
        try:
            sock.sendall(HEADER.pack(MAGIC, AUTH, len(auth), 0) + auth)
            sock.sendall(HEADER.pack(MAGIC, PROMOTE, len(raw), 0) + raw)
        except OSError:
            pass  # closed by the vault already
        while len(frames) < 2 and (frame := _read_frame(sock)) is not None:
            kind, index, data = frame
            assert data == b""
            frames.append((kind, index))
    return frames


@pytest.mark.parametrize(
    "token", [None, "wrong-token-0123456789abcdef", BOB], ids=["none", "wrong", "other-tenant"]
)
def test_without_the_right_token_nothing_comes_back_on_either_port(
    tenants_vault: Any, token: str | None
) -> None:
    with VaultClient(tenants_vault.address, token=token, deadline_s=2) as client:
        assert client.lookup(NS, [key(0)], [0]) == 0
        assert client.promote(NS, [key(0), key(1)], [0]) == {}
        client.put(NS, key(0), 0, b"overwritten")
        client.flush(timeout=10)
        if token is None or token.startswith("wrong"):
            with pytest.raises(VaultRefused):
                client.stats()
            assert client.failed_calls >= 1
        else:  # bob is a tenant of his own: his stats hold only his block
            stats = client.stats()
            assert (stats.tenant, stats.entries, stats.auth_required) == ("bob", 1, True)
            assert client.clear(NS) == 1 and client.delete(NS, [key(1)]) == 0
    # on the bulk port: refused before any frame, or (bob) only his own namespace is reached
    answer = {
        None: lambda nonce: b"",
        "wrong-token-0123456789abcdef": lambda nonce: proof("wrong-token-0123456789abcdef", nonce),
        BOB: lambda nonce: proof(BOB, nonce),
    }[token]
    frames = _bulk_promote_as(tenants_vault.bulk_port, answer)
    if token == BOB:  # welcomed, then a reply with no blocks
        assert [kind for kind, _ in frames] == [WELCOME, PROMOTE_REPLY]
        assert not vault_pb2.PromoteIndex.FromString(frames[1][1]).key_indices
    else:
        assert frames == []
    # on gRPC without a valid call proof: UNAUTHENTICATED for the service and for health alike
    with grpc.insecure_channel(tenants_vault.address) as plain:
        channel = proving_channel(plain, token)
        stub = vault_pb2_grpc.VaultStub(channel)
        request = vault_pb2.PromoteRequest(namespace=NS, keys=[key(0)], parts=[0])
        chunks = []
        try:
            chunks = list(stub.Promote(request, timeout=5))
            assert token == BOB
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        assert all(b"alice's KV" not in chunk for chunk in chunks)
        if token != BOB:
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as failure:
                health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # alice lost nothing
    with VaultClient(tenants_vault.address, token=ALICE) as alice:
        found = alice.promote(NS, [key(i) for i in range(4)], [0])
        assert {k: bytes(v) for k, v in found.items()} == {
            (i, 0): b"alice's KV %d" % i for i in range(4)
        }
        stats = alice.stats()
        assert (stats.tenant, stats.entries) == ("alice", 4)


def test_status_shows_auth_required_and_whether_ours_was_accepted(
    tenants_vault: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "empty.toml"
    config.write_text("")
    args = ["status", "--vault", tenants_vault.address, "--json", "--config", str(config)]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 1
    [row] = json.loads(refused.stdout)["vaults"]
    assert row["auth"] == "required, refused" and "requires a token" in row["reason"]
    assert (row["verdict"], row["reachable"]) == ("refused", True)
    monkeypatch.setenv(TOKEN_ENV, ALICE)
    accepted = runner.invoke(app, args)
    assert accepted.exit_code == 0, accepted.output
    [row] = json.loads(accepted.stdout)["vaults"]
    assert (row["auth"], row["tenant"], row["entries"]) == ("required, accepted", "alice", 4)
    assert ALICE not in accepted.output and ALICE not in refused.output
    assert (row["tls"], row["sealed"]) == (False, False)
    data_key = tmp_path / "data_key"
    data_key.write_text(new_data_key_line(1))
    data_key.chmod(0o600)
    config.write_text(f'[security]\ndata_key_file = "{data_key}"\n')
    [row] = json.loads(runner.invoke(app, args).stdout)["vaults"]
    assert (row["tls"], row["sealed"]) == (False, True)
    table = runner.invoke(app, [*args[:-3], "--config", str(config)]).stdout
    [line] = [line for line in table.splitlines() if tenants_vault.address in line]
    assert line.split()[-1] == "seal"  # the link column: sealed, no TLS
    wide = runner.invoke(app, [*args[:-3], "--wide", "--config", str(config)]).stdout
    assert "required, accepted, tenant alice" in wide


def test_a_single_token_from_the_environment_keeps_namespaces_as_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TOKEN_ENV, ALICE)
    from tierkv.vault.auth import configured_tokens

    server = serve("127.0.0.1:0", 0, tokens=Tokens(configured_tokens(SecurityConfig())))
    try:
        with VaultClient(server.address, token=ALICE) as client:
            client.put(NS, key(7), 0, b"seven")
            assert client.flush(timeout=10) and client.transport == "bulk"
            assert client.promote(NS, [key(7)], [0]) == {(0, 0): b"seven"}
            assert client.stats().tenant == ""
        assert server.store.lookup(NS, [key(7)], [0]) == 1  # stored under NS itself
    finally:
        server.stop(grace=0)


def test_token_files_are_checked_line_by_line(tmp_path: Path) -> None:
    from tierkv.config import ConfigError

    good = tmp_path / "good"
    good.write_text(f"{ALICE}\n")
    good.chmod(0o600)
    assert read_token_file(good) == [("default", ALICE)]
    for text, message in [
        ("", "no token"),
        ("short\n", "at least"),
        (f"bad/name {ALICE}\n", "TENANT TOKEN"),
        (f"a b {ALICE}\n", "TENANT TOKEN"),
    ]:
        bad = tmp_path / "bad"
        bad.write_text(text)
        bad.chmod(0o600)
        with pytest.raises(ConfigError, match=message):
            read_token_file(bad)


def _tierkv(*args: str, config: Path, env: dict[str, str] | None = None) -> list[str]:
    return [sys.executable, "-m", "tierkv", *args, "--config", str(config)]


def test_listening_beyond_loopback_without_a_token_is_refused(
    tmp_path: Path, free_port: int
) -> None:
    config = tmp_path / "empty.toml"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    result = subprocess.run(
        _tierkv("vault", "--listen", f"0.0.0.0:{free_port}", config=config),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "without authentication" in lines[0] and "--insecure" in lines[0]
    assert "listening" not in result.stdout


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (a network namespace)")
def test_insecure_is_announced_at_start_up(tmp_path: Path, free_port: int) -> None:
    """--insecure beyond loopback, run in a network namespace of its own (nothing reachable)."""
    config = tmp_path / "empty.toml"
    config.write_text("")
    command = ["unshare", "--net", "--map-root-user"]
    if subprocess.run([*command, "true"], capture_output=True).returncode:
        pytest.skip("no network namespaces here")
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    process = subprocess.Popen(
        [
            *command,
            *_tierkv("vault", "--listen", f"0.0.0.0:{free_port}", "--insecure", config=config),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(2)]
    finally:
        process.terminate()
        process.wait(timeout=15)
    assert "listening on 0.0.0.0" in lines[0] and "auth: none" in lines[0]
    assert "WARNING --insecure" in lines[1]


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "192.0.2.1:0", "no-such-host.invalid:0"])
def test_serve_itself_refuses_a_listener_beyond_loopback_without_authentication(
    listen: str,
) -> None:
    """The rule holds for every caller of serve(), not only for `tierkv vault` (refused before
    any bind is tried, so nothing listens beyond loopback here)."""
    with pytest.raises(ConfigError, match="beyond loopback, without authentication"):
        serve(listen, 0)


def test_serve_refuses_insecure_together_with_tokens() -> None:
    with pytest.raises(ConfigError, match="--insecure together with tokens"):
        serve("127.0.0.1:0", 0, tokens=Tokens([("default", ALICE)]), insecure=True)


def test_status_shows_an_insecure_vault() -> None:
    server = serve("127.0.0.1:0", 0, insecure=True)
    try:
        result = runner.invoke(app, ["status", "--vault", server.address])
        assert result.exit_code == 0
        assert "degraded" in result.stdout
        assert "started --insecure: open to the LAN without a token" in result.stderr
    finally:
        server.stop(grace=0)


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_tls_round_trip_on_both_ports(tmp_path: Path, mutual: bool) -> None:
    certs = make_certs(tmp_path / "certs")
    vault_side = SecurityConfig(
        tls_cert=str(certs.server_cert),
        tls_key=str(certs.server_key),
        client_ca=str(certs.ca) if mutual else None,
    )
    client_side = SecurityConfig(
        tls_ca=str(certs.ca),
        tls_cert=str(certs.client_cert) if mutual else None,
        tls_key=str(certs.client_key) if mutual else None,
    )
    tokens = Tokens([("default", ALICE)])
    server = serve("127.0.0.1:0", 0, tokens=tokens, security=vault_side)
    try:
        with VaultClient(server.address, token=ALICE, security=client_side) as client:
            blocks = {i: os.urandom(300_000 + i) for i in range(3)}
            for i, payload in blocks.items():
                client.put(NS, key(i), 0, payload)
            assert client.flush(timeout=20) and client.transport == "bulk"
            found = client.promote(NS, [key(i) for i in blocks], [0])
            assert client.transport == "bulk"
            assert {k: bytes(v) for k, v in found.items()} == {(i, 0): p for i, p in blocks.items()}
            assert client.stats().tls
            # Over TLS nothing is placed (no scatter-gather receive): into is not even asked.
            unasked = client.promote(NS, [key(i) for i in blocks], [0], lambda *_: pytest.fail())
            assert {k: bytes(v) for k, v in unasked.items()} == {
                k: bytes(v) for k, v in found.items()
            }
        # A plain client, or (mutual TLS) one without a certificate, gets nothing.
        strangers = [SecurityConfig()]
        if mutual:
            strangers.append(SecurityConfig(tls_ca=str(certs.ca)))
        for security in strangers:
            with VaultClient(server.address, token=ALICE, security=security, deadline_s=2) as c:
                assert c.promote(NS, [key(0)], [0]) == {}
                assert c.lookup(NS, [key(0)], [0]) == 0
    finally:
        server.stop(grace=0)


def test_a_tenants_corrupted_block_is_a_miss_never_laundered() -> None:
    """A tenant's blocks are stored under the checksum of their prefixed address and returned
    with the one of the tenant's own: bit rot in between must still fail the reader's check."""
    server = serve("127.0.0.1:0", 0, tokens=Tokens([("alice", ALICE), ("bob", BOB)]))
    try:
        rotting = bytearray(b"r" * 4096)
        prefixed = b"alice/" + NS
        stored = server.store.put(
            prefixed, key(1), 0, memoryview(rotting), block_checksum(prefixed, key(1), 0, rotting)
        )
        assert stored is None
        with VaultClient(server.address, token=ALICE) as alice:
            assert bytes(alice.promote(NS, [key(1)], [0])[(0, 0)]) == bytes(rotting)
            rotting[100] ^= 0xFF  # bit rot in the vault's RAM after the checksum was verified
            assert alice.promote(NS, [key(1)], [0]) == {}
            assert alice.checksum_failures == 1
        with grpc.insecure_channel(server.address) as plain:  # sent with a wrong checksum
            put = proving_channel(plain, ALICE).stream_unary(
                "/tierkv.v1.Vault/Put", request_serializer=lambda b: b
            )
            index = vault_pb2.PutIndex(
                namespace=NS, keys=[key(2)], parts=[0], lengths=[3], checksums=[12345]
            )
            summary = vault_pb2.PutSummary.FromString(put(iter([encode_bulk(index, [b"abc"])])))
            assert (summary.stored, summary.rejected) == (0, 1)
            assert "checksum" in summary.rejections[0].reason
    finally:
        server.stop(grace=0)
