"""`tierkv status` over 12 real vaults on 127.0.0.1: one row each with its verdict (up, full,
degraded, refused, wrong role, down), totals across RAM and disk, the 80-column table with every
address whole, the JSON fields of each verdict, exit codes, and --watch refreshing in place."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import VaultHandle, pick_free_port, wait_until
from typer.testing import CliRunner

from tierkv.backends.vault import VaultClient
from tierkv.cli import app
from tierkv.vault.auth import Tokens
from tierkv.vault.disk import DiskTier
from tierkv.vault.server import VaultServer, serve
from tierkv.wire.secrets import TOKEN_ENV

MIB = 1 << 20
NS = b"status-test"


@dataclass
class Fleet:
    """Twelve vaults as tierkv.toml's [cluster] names them, and what each must show."""

    config: Path
    expected: dict[str, str]  # name in the table → verdict
    addresses: dict[str, str]  # name → address


def _fill(address: str, count: int, size: int) -> None:
    with VaultClient(address, deadline_s=10) as client:
        for i in range(count):
            client.put(NS, i.to_bytes(16, "little"), 0, b"x" * size)
        assert client.flush(timeout=30)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    servers: list[VaultServer] = []

    def start(max_bytes: int = 64 * MIB, **kwargs: object) -> str:
        server = serve("127.0.0.1:0", max_bytes, **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server.address

    kv = [start() for _ in range(3)]  # up
    disk = DiskTier(root / "disk", 64 * MIB)
    kv.append(start(64 * 1024, disk=disk))  # RAM spills to its disk tier: up, disk shown
    _fill(kv[-1], 200, 1000)
    kv.append(start(64 * 1024))  # full
    _fill(kv[-1], 200, 100)
    kv.append(start())  # degraded: its bulk port is named but unreachable (a firewall)
    servers[-1]._bulk.stop()  # type: ignore[union-attr]
    ssm = [start(role="ssm_cold")]  # up
    ssm.append(start())  # wrong role: a kv_cold vault named as ssm_cold
    ssm.append(start(role="ssm_cold", tokens=Tokens([("", "not-ours-" + "x" * 24)])))  # refused
    ssm += [f"127.0.0.1:{pick_free_port()}" for _ in range(3)]  # down: nothing listens
    key_file = root / "data.keys"
    key_file.write_text("1 " + "A" * 43 + "\n")
    key_file.chmod(0o600)
    config = root / "tierkv.toml"
    config.write_text(
        "[cluster]\n"
        f"kv_cold = {json.dumps(kv)}\nssm_cold = {json.dumps(ssm)}\n"
        f'[client]\ndeadline_ms = 1000\n[security]\ndata_key_file = "{key_file}"\n'
    )
    kv_verdicts = ["up", "up", "up", "up", "full", "degraded"]
    ssm_verdicts = ["up", "wrong role", "refused", "down", "down", "down"]
    expected = {f"kv_cold {i + 1}": v for i, v in enumerate(kv_verdicts)}
    expected |= {f"ssm_cold {i + 1}": v for i, v in enumerate(ssm_verdicts)}
    addresses = {f"kv_cold {i + 1}": a for i, a in enumerate(kv)}
    addresses |= {f"ssm_cold {i + 1}": a for i, a in enumerate(ssm)}
    yield Fleet(config, expected, addresses)
    for server in servers:
        server.stop(grace=0)
    disk.close()


@pytest.fixture(autouse=True)
def no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def status(*args: str, columns: int = 80) -> tuple[int, str, str]:
    result = CliRunner(env={"COLUMNS": str(columns)}).invoke(app, ["status", *args])
    return result.exit_code, result.stdout, result.stderr


def test_table_of_12_vaults_fits_80_columns_with_every_address_whole(fleet: Fleet) -> None:
    code, out, err = status("--config", str(fleet.config))
    assert code == 1, out + err
    lines = [line.strip() for line in out.splitlines()]
    assert max(len(line) for line in out.splitlines()) <= 80, out
    for name, verdict in fleet.expected.items():
        [line] = [line for line in lines if line.startswith(f"{name} ")]
        assert fleet.addresses[name] in line and verdict in line, line
    [total] = [line for line in lines if line.startswith("total")]
    assert "7 of 12 serving" in total  # up, full and degraded serve; the rest do not
    assert "tls" not in out and "seal" in out  # no TLS configured; a data key is
    assert "/64K" in next(line for line in lines if line.startswith("kv_cold 5 "))  # full
    # One plain line per row that is not plainly up, no gRPC status text.
    assert "UNAVAILABLE" not in err and "DEADLINE" not in err
    assert len(err.splitlines()) == 7, err
    assert "ssm_cold 2: wrong role, serves kv_cold, but tierkv.toml's [cluster]" in err
    assert "ssm_cold 3: refused, answers, but requires a token and we have none" in err
    assert "ssm_cold 4: down, nothing listens at 127.0.0.1:" in err
    assert "kv_cold 5: full, RAM tier at" in err
    assert "kv_cold 6: degraded, bulk port" in err


def test_wide_table_shows_every_figure(fleet: Fleet) -> None:
    code, out, _ = status("--config", str(fleet.config), "--wide", columns=400)
    assert code == 1
    for label in ("rtt ms", "disk used / cap", "bulk port", "uptime", "reason", "share"):
        assert label in out
    assert "connection refused" in out  # reasons are a column of the wide table


def test_json_has_a_verdict_and_its_fields_per_row(fleet: Fleet) -> None:
    code, out, _ = status("--config", str(fleet.config), "--json")
    assert code == 1
    found = json.loads(out)
    rows = {row["name"]: row for row in found["vaults"]}
    assert {name: row["verdict"] for name, row in rows.items()} == fleet.expected
    for row in rows.values():
        assert (row["tls"], row["sealed"]) == (False, True)
        assert row["up"] == (row["verdict"] in ("up", "full", "degraded"))
        assert row["reachable"] == (row["verdict"] != "down")
        assert ("reason" in row) == (row["verdict"] != "up")
    refused, down = rows["ssm_cold 3"], rows["ssm_cold 4"]
    assert refused["reachable"] and not refused["up"]  # refused is not down
    assert not down["reachable"] and "connection refused" in down["reason"]
    disk = rows["kv_cold 4"]["disk"]
    assert disk["entries"] > 0 and rows["kv_cold 4"]["evictions"] > 0  # moved RAM → disk
    totals = found["totals"]
    assert totals["vaults"] == 12
    assert totals["verdicts"] == {
        "up": 5, "full": 1, "degraded": 1, "refused": 1, "wrong role": 1, "down": 3
    }  # fmt: skip
    assert totals["disk_bytes_used"] == disk["bytes_used"] > 0
    assert totals["entries"] >= 200 + rows["kv_cold 5"]["entries"]  # RAM and disk counted


def test_exit_codes(fleet: Fleet) -> None:
    a = fleet.addresses
    assert status("--vault", a["kv_cold 1"], "--vault", a["ssm_cold 1"])[0] == 0
    # Full and degraded still serve us: exit 0, the reason said.
    code, _, err = status("--vault", a["kv_cold 5"], "--vault", a["kv_cold 6"])
    assert code == 0 and "full" in err and "degraded" in err
    assert status("--vault", a["ssm_cold 3"])[0] == 1  # refused
    assert status("--vault", a["ssm_cold 4"])[0] == 1  # down
    # A role is only checked against tierkv.toml's [cluster]: a kv_cold vault named ssm_cold.
    config = fleet.config.with_name("wrong_role.toml")
    config.write_text(f'[cluster]\nssm_cold = "{a["ssm_cold 2"]}"\n')
    code, _, err = status("--config", str(config))
    assert code == 1 and "serves kv_cold, but tierkv.toml's [cluster] names it as ssm_cold" in err
    assert status("--json", "--watch")[0] == 2


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_watch_writes_a_frame_per_check_to_a_pipe_and_stops_on_a_signal(
    fleet: Fleet, spawn: Callable[..., subprocess.Popen[bytes]], stop: signal.Signals
) -> None:
    """Started with SIGINT and SIGTERM ignored (as a background job of a non-interactive shell
    starts it), `--watch` still stops on either, with exit 0 and the frames it wrote."""
    a = fleet.addresses
    args = ["status", "--watch", "--interval", "0.2", "--vault", a["kv_cold 1"]]

    def ignore_signals() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)

    process = spawn(
        [sys.executable, "-m", "tierkv", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "80"},
        preexec_fn=ignore_signals,
    )
    assert process.stdout is not None
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, b"")))
    reader.start()
    # Each frame comes flushed: the pipe sees it while the watch runs.
    assert wait_until(lambda: sum(line.startswith(b"checked ") for line in lines) >= 2, 60)
    process.send_signal(stop)
    # Ended by the watch itself: its verdict's code (0 up; 1 where a check on a loaded machine
    # missed its deadline), never the signal's (-15, or 130 for an interrupt it did not catch).
    code = process.wait(timeout=30)
    assert code in (0, 1), process.stderr.read() if process.stderr else ""
    reader.join(timeout=30)
    out = b"".join(lines)
    assert (
        out.count(a["kv_cold 1"].encode()) >= 2 and b"\x1b[" not in out
    )  # plain text, no cursor moves


def test_a_long_address_wraps_in_its_column_and_no_figure_is_dropped(
    vault_factory: Callable[..., VaultHandle],
) -> None:
    up = vault_factory()
    long = "[fd00:1234:5678:9abc:def0:1234:5678:9abc]:50051"  # ":1234:" is no emoji code either
    result = CliRunner(env={"COLUMNS": "80"}).invoke(
        app, ["status", "--vault", up.address, "--vault", long]
    )
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, result.stdout
    header = next(line for line in lines if " address " in line)
    assert header.split() == ["name", "address", "state", "RAM", "disk", "hits", "link"]
    row = next(line for line in lines if line.startswith(" vault 1 "))
    assert "0B/1.0G" in row and " up " in row, result.stdout
    address_column = slice(header.index("address"), header.index("state"))
    assert long in "".join(line[address_column].strip() for line in lines), result.stdout
