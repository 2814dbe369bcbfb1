"""The disk tier keeps its promises whatever is done to its directory: a missing, replaced or
short `record.key` never costs a byte (a real `tierkv vault` refuses to start with one line
naming the file; `--disk-reset` starts empty), its files are private whatever the umask, and a
torn tail of record-magic bytes costs recovery a bounded number of header checks.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import VaultHandle, key
from test_vault_disk_process import disk_vault, log_of, payload, put_all, read_back

from tierkv.checksum import block_checksum
from tierkv.sizes import MIB
from tierkv.vault import disk as disk_module
from tierkv.vault.disk import MAGIC, MAX_RESYNC_CANDIDATES, RECORD_KEY_NAME, DiskTier

NS = b"disk-test-000000"


def _segment_sizes(directory: Path) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in directory.glob("*.seg")}


def _start(directory: Path, tmp_path: Path, *more: str) -> subprocess.CompletedProcess[str]:
    """`tierkv vault --disk-dir DIRECTORY` that is expected to refuse to start."""
    config = tmp_path / "refused.toml"
    config.write_text("")
    command = [sys.executable, "-m", "tierkv", "vault", "--config", str(config)]
    command += ["--listen", "127.0.0.1:0", "--disk-dir", str(directory), *more]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def _filled(vault_factory: Callable[..., VaultHandle], directory: Path, blocks: int) -> None:
    vault = disk_vault(vault_factory, directory)
    put_all(vault.address, range(blocks))
    vault.stop()


@pytest.mark.parametrize("damage", ["missing", "replaced", "short"])
def test_a_lost_record_key_refuses_to_start_and_costs_no_byte(
    vault_factory: Callable[..., VaultHandle], tmp_path: Path, damage: str
) -> None:
    directory = tmp_path / "disk"
    _filled(vault_factory, directory, 12)
    sizes = _segment_sizes(directory)
    key_path = directory / RECORD_KEY_NAME
    saved = key_path.read_bytes()
    if damage == "missing":
        key_path.unlink()
    else:
        key_path.write_bytes(os.urandom(32 if damage == "replaced" else 31))
    refused = _start(directory, tmp_path)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert str(key_path) in line and "--disk-reset" in line and "restore" in line
    assert "listening" not in refused.stdout
    assert _segment_sizes(directory) == sizes  # not a byte truncated
    key_path.write_bytes(saved)
    again = disk_vault(vault_factory, directory)
    assert "recovered 12 blocks" in log_of(again)
    assert len(read_back(again.address, 12)) == 12


def test_disk_reset_starts_empty(vault_factory: Callable[..., VaultHandle], tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    _filled(vault_factory, directory, 4)
    (directory / RECORD_KEY_NAME).unlink()
    vault = disk_vault(vault_factory, directory, "--disk-reset")
    log = log_of(vault)
    assert "reset" in log and "recovered 0 blocks" in log
    assert read_back(vault.address, 4) == {}
    put_all(vault.address, [7])
    assert len(read_back(vault.address, [7])) == 1


def test_disk_files_are_private_whatever_the_umask(
    vault_factory: Callable[..., VaultHandle], tmp_path: Path
) -> None:
    directory = tmp_path / "disk"
    old = os.umask(0)
    try:
        vault = disk_vault(vault_factory, directory)
    finally:
        os.umask(old)
    put_all(vault.address, range(12))  # past the 2 MiB RAM tier: segments written
    assert _segment_sizes(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name


def test_a_directory_an_older_vault_left_open_is_made_private(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    disk = DiskTier(directory, 64 * MIB)
    disk.write(NS, key(1), 0, payload(1), block_checksum(NS, key(1), 0, payload(1)))
    disk.close(timeout=30)
    for path in directory.iterdir():
        path.chmod(0o644)
    DiskTier(directory, 64 * MIB).close(timeout=30)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert {stat.S_IMODE(path.stat().st_mode) for path in directory.iterdir()} == {0o600}


def test_a_torn_tail_of_record_magic_costs_a_bounded_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant's payload of nothing but record magic, cut by a crash: recovery checks at most
    MAX_RESYNC_CANDIDATES headers in it (not one per 4 bytes) and keeps every whole block."""
    directory = tmp_path / "disk"
    disk = DiskTier(directory, 256 * MIB)
    for i in range(4):
        disk.write(NS, key(i), 0, payload(i), block_checksum(NS, key(i), 0, payload(i)))
    disk.close(timeout=30)
    [segment] = directory.glob("*.seg")
    tail = MAGIC * (2 * MIB)  # 8 MiB: two million places a header could start
    with segment.open("ab") as out:
        out.write(tail)
    checked = 0
    read_header = disk_module._read_header

    def counted(*args: object, **kwargs: object) -> object:
        nonlocal checked
        checked += 1
        return read_header(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_module, "_read_header", counted)
    disk = DiskTier(directory, 256 * MIB)
    try:
        assert checked <= MAX_RESYNC_CANDIDATES + 8
        assert disk.recovery.blocks == 4 and disk.recovery.damaged
        found = disk.read_many(NS, [(key(i), 0) for i in range(4)])
        assert [bytes(item[0]) for item in found if item] == [payload(i) for i in range(4)]
    finally:
        disk.close(timeout=30)
