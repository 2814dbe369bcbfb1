"""`tierkv vault` as a real process (start-up line, taken port, signals) and `tierkv status`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import pick_free_port, wait_until
from typer.testing import CliRunner

from tierkv.backends.vault import VaultClient
from tierkv.cli import app

runner = CliRunner(env={"COLUMNS": "200"})


def tierkv(*args: str, config: Path) -> list[str]:
    return [sys.executable, "-m", "tierkv", *args, "--config", str(config)]


@pytest.fixture
def empty_config(tmp_path: Path) -> Path:
    path = tmp_path / "tierkv.toml"
    path.write_text("")
    return path


def read_line(process: subprocess.Popen[str], timeout: float = 30) -> str:
    """The first stdout line of `process` (fails the test if none comes in time)."""
    stdout = process.stdout
    assert stdout is not None
    lines: list[str] = []

    def read_or_exited() -> bool:
        lines.append(stdout.readline())
        return bool(lines[-1]) or process.poll() is not None

    wait_until(read_or_exited, timeout, interval=0.05)
    if not lines[-1]:
        pytest.fail(f"no output from {process.args}")
    return lines[-1]


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_vault_starts_with_one_line_and_stops_gracefully(
    free_port: int, empty_config: Path, stop_signal: signal.Signals
) -> None:
    address, bulk_port = f"127.0.0.1:{free_port}", pick_free_port()
    args = ["--listen", address, "--role", "ssm_cold", "--bulk-port", str(bulk_port)]
    process = subprocess.Popen(
        tierkv("vault", *args, config=empty_config),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = read_line(process)
        assert f"ssm_cold listening on {address} (bulk data on port {bulk_port})" in line
        assert "cap " in line and "default: 50% of" in line and "RAM" in line
        result = runner.invoke(app, ["status", "--vault", address, "--json"])
        assert result.exit_code == 0, result.output
        [row] = json.loads(result.stdout)["vaults"]
        assert row["up"] and row["role"] == "ssm_cold"
        assert (row["bulk_port"], row["bulk_reachable"]) == (bulk_port, True)
        # It restarted itself (exec, same pid) with glibc's huge-page heap asked for.
        environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        assert any(
            line.startswith(b"GLIBC_TUNABLES=") and b"glibc.malloc.hugetlb=1" in line
            for line in environ
        ), environ
        process.send_signal(stop_signal)
        assert process.wait(timeout=15) == 0
        assert "stopped" in process.stdout.read()  # type: ignore[union-attr]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_vault_on_a_taken_port_exits_non_zero_without_claiming_to_listen(
    vault_factory: Callable[..., Any], empty_config: Path
) -> None:
    taken = vault_factory()
    result = subprocess.run(
        tierkv("vault", "--listen", taken.address, "--max-bytes", "1GiB", config=empty_config),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "listening" not in result.stdout
    assert f"cannot listen on {taken.address}" in result.stderr
    assert "in use" in result.stderr


def test_vault_on_an_address_not_on_this_machine_exits_1(empty_config: Path) -> None:
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: the bind fails, nothing is sent.
    # (--insecure gets past the refusal to listen beyond loopback without authentication.)
    result = subprocess.run(
        tierkv("vault", "--listen", "192.0.2.1:50051", "--insecure", config=empty_config),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "listening" not in result.stdout
    assert "cannot listen on 192.0.2.1:50051" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "127.0.0.1"], "--listen: expected host:port"),
        (["--max-bytes", "lots"], "--max-bytes: expected a size"),
        (["--role", "inference"], "--role: expected one of kv_cold, ssm_cold"),
        (["--disk-max-bytes", "1GiB"], "--disk-max-bytes needs --disk-dir"),
        (["--disk-dir", "unused", "--disk-max-bytes", "0"], "--disk-max-bytes: expected"),
    ],
)
def test_vault_bad_options_exit_2(args: list[str], message: str, empty_config: Path) -> None:
    result = runner.invoke(app, ["vault", *args, "--config", str(empty_config)])
    assert result.exit_code == 2
    assert message in result.stderr


def test_vault_bad_config_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[vault]\nmax_bytes = -3\n")
    result = runner.invoke(app, ["vault", "--config", str(config)])
    assert result.exit_code == 2
    assert f"{config}: vault.max_bytes" in result.stderr


def test_status_reads_the_configured_vaults(
    vault_factory: Callable[..., Any], free_port: int, tmp_path: Path
) -> None:
    up = vault_factory(role="kv_cold")
    config = tmp_path / "tierkv.toml"
    config.write_text(f'[cluster]\nkv_cold = "{up.address}"\n[client]\ndeadline_ms = 500\n')
    result = runner.invoke(app, ["status", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "kv_cold" in result.stdout and "up" in result.stdout

    config.write_text(
        f'[cluster]\nkv_cold = "{up.address}"\nssm_cold = "127.0.0.1:{free_port}"\n'
        "[client]\ndeadline_ms = 500\n"
    )
    result = runner.invoke(app, ["status", "--config", str(config), "--json"])
    assert result.exit_code == 1
    rows = {row["name"]: row for row in json.loads(result.stdout)["vaults"]}
    assert rows["kv_cold"]["up"] and rows["kv_cold"]["entries"] == 0
    assert (rows["kv_cold"]["bulk_port"], rows["kv_cold"]["bulk_reachable"]) == (
        up.server.bulk_port,
        True,
    )
    assert rows["ssm_cold"]["verdict"] == "down" and not rows["ssm_cold"]["reachable"]
    assert "nothing listens at" in rows["ssm_cold"]["reason"]


def test_status_tells_a_vault_without_bulk_path(vault_factory: Callable[..., Any]) -> None:
    grpc_only = vault_factory(bulk=False)
    result = runner.invoke(app, ["status", "--vault", grpc_only.address, "--wide"])
    assert result.exit_code == 0, result.output
    assert "none (gRPC)" in result.stdout


def test_unreachable_bulk_port_is_shown_and_clients_fall_back_to_grpc(
    vault_factory: Callable[..., Any],
) -> None:
    vault = vault_factory()
    vault.server._bulk.stop()  # a firewall in front of the bulk port: Hello still names it
    result = runner.invoke(app, ["status", "--vault", vault.address, "--wide"])
    assert result.exit_code == 0, result.output
    assert f"{vault.server.bulk_port} unreachable (gRPC, slower)" in result.stdout
    namespace, key = b"n" * 16, b"k" * 16
    with VaultClient(vault.address) as client:
        client.put(namespace, key, 0, b"payload")
        assert client.flush(timeout=10)
        found = client.promote(namespace, [key], [0])
        assert bytes(found[0, 0]) == b"payload"
        assert client.transport == "grpc"


def test_status_down_vault_table_exits_1(free_port: int, empty_config: Path) -> None:
    result = runner.invoke(
        app, ["status", "--config", str(empty_config), "--vault", f"127.0.0.1:{free_port}"]
    )
    assert result.exit_code == 1
    assert "down" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vault", "nowhere"], "--vault: expected host:port"),
        (["--config", "/nonexistent/tierkv.toml"], "config file not found"),
    ],
)
def test_status_config_errors_exit_2(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["status", *args])
    assert result.exit_code == 2
    assert message in result.stderr


def _json_row(*args: str) -> tuple[int, dict[str, Any]]:
    result = runner.invoke(app, ["status", "--json", *args])
    assert result.stdout, result.stderr
    return result.exit_code, json.loads(result.stdout)["vaults"][0]


def test_status_names_a_wrong_ca_apart_from_an_unreachable_port(tmp_path: Path) -> None:
    """The vault's own certificate (or another) given as the CA: TLS verification failed, not
    a firewall."""
    from tls_certs import make_certs

    from tierkv.config import SecurityConfig
    from tierkv.vault.server import serve

    certs = make_certs(tmp_path / "certs")
    tls = SecurityConfig(tls_cert=str(certs.server_cert), tls_key=str(certs.server_key))
    server = serve("127.0.0.1:0", 1 << 28, security=tls)
    config = tmp_path / "tierkv.toml"
    try:
        for ca, verdict in ((certs.ca, "up"), (certs.server_cert, None), (certs.client_cert, None)):
            config.write_text(f'[security]\ntls_ca = "{ca}"\n')
            code, row = _json_row("--config", str(config), "--vault", server.address)
            if verdict == "up":
                assert (code, row["verdict"]) == (0, "up"), row
                continue
            assert row["verdict"] in ("degraded", "down"), row
            assert row["reason"].startswith("TLS verification failed at port "), row
            assert f"is security.tls_ca {ca} the CA that signed" in row["reason"], row
            assert "unreachable" not in row["reason"]
    finally:
        server.stop(0)


@pytest.mark.parametrize("command", ["status", "vault"])
def test_a_tls_file_that_is_not_pem_is_one_line_naming_it(tmp_path: Path, command: str) -> None:
    """A garbage CA (engine side) or certificate (vault side): exit 2, the setting and file
    named, before anything connects or listens."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    key = tmp_path / "key.pem"
    key.write_text("not a key either\n")
    key.chmod(0o600)
    config = tmp_path / "tierkv.toml"
    if command == "status":
        config.write_text('[security]\ntls_ca = "garbage.pem"\n')
        args = ["status", "--config", str(config), "--vault", "127.0.0.1:9"]
        named = f"security.tls_ca {garbage}: not a usable PEM file"
    else:
        config.write_text('[security]\ntls_cert = "garbage.pem"\ntls_key = "key.pem"\n')
        args = ["vault", "--config", str(config), "--listen", "127.0.0.1:0", "--max-bytes", "64MiB"]
        named = f"security.tls_cert {garbage} with tls_key {key}: not a usable PEM file"
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"tierkv {command}: {named}"), line


def test_status_refuses_a_data_key_that_does_not_parse(tmp_path: Path) -> None:
    key = tmp_path / "data_key"
    key.write_text("1 not-a-key\n")
    key.chmod(0o600)
    config = tmp_path / "tierkv.toml"
    config.write_text('[security]\ndata_key_file = "data_key"\n')
    result = runner.invoke(app, ["status", "--config", str(config), "--vault", "127.0.0.1:9"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"tierkv status: security.data_key_file {key}: line 1: key 1 is not URL-safe base64"
    )


def test_status_warns_of_a_redis_that_will_refuse_or_outgrow(tmp_path: Path) -> None:
    from redis_servers import start_redis

    settings = {
        ("64mb", "allkeys-lru"): [],
        ("0", "allkeys-lru"): ["maxmemory 0"],
        ("64mb", "noeviction"): ["maxmemory-policy noeviction: stores fail once it is full"],
    }
    for (maxmemory, policy), problems in settings.items():
        server = start_redis(tmp_path, "--maxmemory", maxmemory, "--maxmemory-policy", policy)
        try:
            code, row = _json_row("--vault", f"redis://{server.address}")
        finally:
            server.stop()
        assert code == 0, row
        assert row["verdict"] == ("degraded" if problems else "up"), row
        assert all(problem in row.get("reason", "") for problem in problems), row
