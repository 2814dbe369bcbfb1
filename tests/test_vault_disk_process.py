"""A real `tierkv vault --disk-dir` process: spill past RAM, restarts, crashes, damage, cap, lock.

Each test runs on a plain directory under tmp_path and on tmpfs (the `disk_dir` fixture). Blocks
carry distinct bytes; every block read back is compared byte for byte with what was stored.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from helpers import LOOPBACK, VaultHandle, key, wait_until
from test_vault_attacks import peak_rss_bytes
from test_vault_auth import ALICE, BOB
from test_vault_disk import forged_record

from tierkv.backends.base import BackendStats
from tierkv.backends.vault import VaultClient
from tierkv.backends.vault_bulk import BulkConnection, BulkError
from tierkv.checksum import block_checksum
from tierkv.sizes import MIB, format_size
from tierkv.vault.disk import KIND_BLOCK, KIND_CLEAR
from tierkv.wire._pb import vault_pb2

NS = b"disk-test-000000"
BLOCK = 256 * 1024
RAM_CAP = "2MiB"  # 8 blocks


def payload(i: int, size: int = BLOCK) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4))[:size]


def put_all(address: str, indices: Sequence[int]) -> None:
    """Store the blocks and wait until the vault acknowledged every one."""
    with VaultClient(address, deadline_s=30, max_pending_bytes=64 * MIB) as client:
        for i in indices:
            client.put(NS, key(i), 0, payload(i))
        assert client.flush(timeout=60), client.counters()
        assert client.stored_puts == len(indices), client.counters()


def read_back(
    address: str, wanted: int | Sequence[int], size_of: Callable[[int], int] = lambda _: BLOCK
) -> dict[int, bytes]:
    """Every block of `wanted` (a count: 0..count-1) the vault returns, each checked byte for
    byte (block i of `size_of(i)` bytes)."""
    indices = range(wanted) if isinstance(wanted, int) else wanted
    with VaultClient(address, deadline_s=30, promote_deadline_s=120) as client:
        found = client.promote(NS, [key(i) for i in indices], [0])
        assert client.checksum_failures == 0
    blocks = {indices[index]: bytes(data) for (index, _), data in found.items()}
    for index, data in blocks.items():
        assert data == payload(index, size_of(index)), f"block {index} came back altered"
    return blocks


def stats(address: str) -> BackendStats:
    with VaultClient(address) as client:
        return client.stats()


def disk_vault(
    vault_factory: Callable[..., VaultHandle], disk_dir: Path, *more: str, fsync: str = "interval"
) -> VaultHandle:
    args = ["--disk-dir", str(disk_dir), *more]
    config = f'[vault]\nfsync = "{fsync}"\n'
    return vault_factory(RAM_CAP, subprocess=True, args=args, config=config)


def log_of(vault: VaultHandle) -> str:
    assert vault.log_path is not None
    return vault.log_path.read_text()


def test_blocks_spill_past_the_ram_cap_and_read_back(
    vault_factory: Callable[..., VaultHandle], disk_dir: Path
) -> None:
    vault = disk_vault(vault_factory, disk_dir)
    put_all(vault.address, range(40))  # 10 MiB through a 2 MiB RAM tier
    assert len(read_back(vault.address, 40)) == 40
    after = stats(vault.address)
    assert after.ram is not None and after.disk is not None
    assert after.ram.bytes_used <= 2 * MIB and after.ram.entries <= 8
    assert after.disk.entries == 40 and after.disk.hits >= 32
    with VaultClient(vault.address) as client:
        assert client.lookup(NS, [key(i) for i in range(41)], [0]) == 40
    status = [sys.executable, "-m", "tierkv", "status", "--vault", vault.address, "--json"]
    [row] = json.loads(subprocess.run(status, capture_output=True, check=True).stdout)["vaults"]
    assert row["ram"]["entries"] == after.ram.entries and row["disk"]["entries"] == 40


def test_sigterm_and_restart_lose_no_acknowledged_block(
    vault_factory: Callable[..., VaultHandle], disk_dir: Path
) -> None:
    vault = disk_vault(vault_factory, disk_dir)
    put_all(vault.address, range(60))
    vault.stop()  # SIGTERM right after the last acknowledgement
    assert "disk tier flushed" in log_of(vault)
    again = disk_vault(vault_factory, disk_dir)
    assert "recovered 60 blocks (15.0 MiB)" in log_of(again)
    assert len(read_back(again.address, 60)) == 60


def test_status_tells_the_disk_live_bytes_from_dead_records_across_a_restart(
    vault_factory: Callable[..., VaultHandle], disk_dir: Path
) -> None:
    """Blocks written twice leave dead records in their segments: status reports the segment
    bytes against the cap and, apart, the bytes still readable, before and after a restart."""
    vault = disk_vault(vault_factory, disk_dir)
    put_all(vault.address, range(40))
    put_all(vault.address, range(40))  # the same keys again: the first records are dead
    before = stats(vault.address).disk
    assert before is not None and 0 < before.live_bytes < before.bytes_used
    vault.stop()
    again = disk_vault(vault_factory, disk_dir)
    after = stats(again.address).disk
    assert after is not None and after.live_bytes == before.live_bytes < after.bytes_used
    status = [sys.executable, "-m", "tierkv", "status", "--vault", again.address]
    [row] = json.loads(subprocess.run([*status, "--json"], capture_output=True, check=True).stdout)[
        "vaults"
    ]
    assert row["disk"]["live_bytes"] == after.live_bytes
    wide = subprocess.run([*status, "--wide"], capture_output=True, text=True, check=True)
    assert f"({format_size(after.live_bytes)})" in wide.stdout, wide.stdout


@pytest.mark.parametrize("fsync", ["never", "interval", "always"])
def test_kill_9_mid_write_loses_no_acknowledged_block(
    vault_factory: Callable[..., VaultHandle], disk_dir: Path, fsync: str
) -> None:
    """Under every fsync mode a Put is acknowledged once its blocks are written to their
    segment (the page cache, which a crash of the vault process leaves alone): after kill -9
    every acknowledged block comes back, intact; only blocks in flight may be missing."""
    vault = disk_vault(vault_factory, disk_dir, fsync=fsync)
    acknowledged: set[int] = set()
    sent: set[int] = set()
    lock = threading.Lock()
    writers = [
        threading.Thread(target=put_until_killed, args=(vault, first, sent, acknowledged, lock))
        for first in (0, 100_000)
    ]
    for writer in writers:
        writer.start()

    def enough_acknowledged() -> bool:  # 30 MiB acknowledged, more in flight
        assert all(w.is_alive() for w in writers)
        return len(acknowledged) >= 120

    assert wait_until(enough_acknowledged, 120, interval=0.01)
    vault.kill()
    for writer in writers:
        writer.join()
    again = disk_vault(vault_factory, disk_dir, fsync=fsync)
    blocks = read_back(again.address, sorted(sent))  # each one returned is checked byte for byte
    print(
        f"kill -9, fsync {fsync}, {disk_dir}: {len(acknowledged)} blocks acknowledged, "
        f"{len(acknowledged & set(blocks))} of them back; {len(sent)} sent, {len(blocks)} back"
    )
    print(log_of(again).splitlines()[0])
    assert acknowledged <= set(blocks)


def put_until_killed(
    vault: VaultHandle,
    first: int,
    sent: set[int],
    acknowledged: set[int],
    lock: threading.Lock,
    size_of: Callable[[int], int] = lambda _: BLOCK,
    per_frame: int = 4,
    refusals: dict[int, str] | None = None,
) -> None:
    """PUT frames of `per_frame` blocks (block j of `size_of(j)` bytes) on a bulk connection of
    its own until the vault dies; adds each block to `sent` before sending it and to
    `acknowledged` once the vault said it stored it (else its reason to `refusals`)."""
    with VaultClient(vault.address) as client:
        port, _ = client.bulk_path()
    connection = BulkConnection(LOOPBACK, port, timeout_s=30)
    i = first
    try:
        while True:
            indices = range(i, i + per_frame)
            i += per_frame
            payloads = [payload(j, size_of(j)) for j in indices]
            index = vault_pb2.PutIndex(
                namespace=NS,
                keys=[key(j) for j in indices],
                parts=[0] * per_frame,
                lengths=[len(data) for data in payloads],
                checksums=[
                    block_checksum(NS, key(j), 0, data)
                    for j, data in zip(indices, payloads, strict=True)
                ],
            )
            with lock:
                sent.update(indices)
            [summary] = connection.put([(index, payloads)], time.monotonic() + 60)
            rejected = {r.key: r.reason for r in summary.rejections}
            with lock:
                acknowledged.update(j for j in indices if key(j) not in rejected)
                if refusals is not None:
                    refusals.update((j, rejected[key(j)]) for j in indices if key(j) in rejected)
    except BulkError:
        return  # the vault was killed


DISK_CAP = "16MiB"
MIXED = (48 * 1024, 15 * MIB + MIB // 2, 300 * 1024, 17 * MIB, MIB, 7 * 1024)
"""Block sizes of a mixed stream: the 15.5 and 17 MiB ones never fit a 16 MiB disk tier."""


def mixed_size(i: int) -> int:
    return MIXED[i % len(MIXED)]


def test_kill_9_during_puts_of_mixed_sizes_loses_no_acknowledged_block(
    vault_factory: Callable[..., VaultHandle], disk_dir: Path
) -> None:
    """A block larger than the disk tier was acknowledged, then left out of the disk without a
    word, and gone after kill -9: such blocks are refused with the reason, and every block
    acknowledged comes back, intact, from a stream of blocks of every size."""
    args = ["--disk-dir", str(disk_dir), "--disk-max-bytes", DISK_CAP]
    vault = vault_factory("64MiB", subprocess=True, args=args)  # RAM would hold them all
    acknowledged: set[int] = set()
    sent: set[int] = set()
    refusals: dict[int, str] = {}
    lock = threading.Lock()
    writers = [
        threading.Thread(
            target=put_until_killed,
            args=(vault, first, sent, acknowledged, lock, mixed_size, 1, refusals),
        )
        for first in (0, 100_002)  # (both writers start the cycle of sizes at the same place)
    ]
    for writer in writers:
        writer.start()

    def enough_acknowledged() -> bool:  # about 4 MiB acknowledged: the disk cap drops nothing yet
        assert all(w.is_alive() for w in writers)
        return len(acknowledged) >= 16

    assert wait_until(enough_acknowledged, 120, interval=0.005)
    vault.kill()
    for writer in writers:
        writer.join()
    again = vault_factory("64MiB", subprocess=True, args=args)
    blocks = read_back(again.address, sorted(sent), mixed_size)  # each checked byte for byte
    assert acknowledged <= set(blocks), sorted(acknowledged - set(blocks))
    too_big = {i for i in sent if mixed_size(i) > 15 * MIB}
    assert too_big and not too_big & acknowledged
    assert all("never fits the disk tier" in refusals[i] for i in too_big & set(refusals))


def test_a_damaged_segment_byte_is_a_miss_for_that_block_only(
    vault_factory: Callable[..., VaultHandle], disk_dir: Path
) -> None:
    vault = disk_vault(vault_factory, disk_dir)
    put_all(vault.address, range(20))
    vault.stop()
    [segment] = sorted(disk_dir.glob("*.seg"))[:1]
    data = segment.read_bytes()
    at = data.index(payload(7)) + 1234
    with segment.open("r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x01]))
    again = disk_vault(vault_factory, disk_dir)
    assert sorted(read_back(again.address, 20)) == [i for i in range(20) if i != 7]
    damaged = stats(again.address).disk
    assert damaged is not None and damaged.corrupt == 1


def test_the_disk_cap_is_honoured(
    vault_factory: Callable[..., VaultHandle], disk_dir: Path
) -> None:
    cap = 8 * MIB
    vault = disk_vault(vault_factory, disk_dir, "--disk-max-bytes", "8MiB")
    for wave in range(4):
        put_all(vault.address, range(wave * 20, wave * 20 + 20))
        if wave == 0:
            read_back(vault.address, [2])  # from disk (RAM holds 8 newer blocks): a second chance
        disk = stats(vault.address).disk
        assert disk is not None and disk.max_bytes == cap and disk.bytes_used <= cap
    assert disk.kept >= 1
    status = [sys.executable, "-m", "tierkv", "status", "--vault", vault.address, "--json"]
    [row] = json.loads(subprocess.run(status, capture_output=True, check=True).stdout)["vaults"]
    assert row["disk"]["kept"] == disk.kept
    vault.stop()
    assert sum(path.stat().st_size for path in disk_dir.glob("*.seg")) <= cap
    again = disk_vault(vault_factory, disk_dir, "--disk-max-bytes", "8MiB")
    kept = sorted(set(read_back(again.address, 80)) - {2})
    assert 16 <= len(kept) <= 32 and kept == list(range(80 - len(kept), 80))  # the newest


def test_tiny_blocks_cannot_grow_the_vault_past_its_ram_cap_through_the_disk_index(
    vault_factory: Callable[..., VaultHandle], disk_dir: Path
) -> None:
    """60,000 four-byte blocks on a 16 MiB vault with a roomy disk: the disk tier's index (about
    600 B a block, 34 MiB for them all) is RAM the cap counts, so the oldest go instead."""
    vault = vault_factory("16MiB", subprocess=True, args=["--disk-dir", str(disk_dir)], config="")
    before = peak_rss_bytes(vault.process.pid)
    with VaultClient(vault.address, deadline_s=60, max_pending_bytes=64 * MIB) as client:
        for start in range(0, 60_000, 5_000):
            for i in range(start, start + 5_000):
                client.put(NS, key(i), 0, payload(i, 4))
            assert client.flush(timeout=120), client.counters()
        assert client.stored_puts == 60_000, client.last_rejections[:3]
    disk = stats(vault.address).disk
    grown = peak_rss_bytes(vault.process.pid) - before
    print(f"\n60,000 four-byte blocks, 16 MiB cap: vault RSS +{grown / MIB:.0f} MiB, "
          f"{disk.entries if disk else 0} on disk")  # fmt: skip
    assert disk is not None and 0 < disk.entries < 60_000
    assert grown < 24 * MIB
    assert 59_999 in read_back(vault.address, [59_999], size_of=lambda _: 4)


def test_a_second_vault_on_the_same_disk_dir_refuses(
    vault_factory: Callable[..., VaultHandle], disk_dir: Path, tmp_path: Path
) -> None:
    vault = disk_vault(vault_factory, disk_dir)
    assert vault.process is not None
    config = tmp_path / "second.toml"
    config.write_text("")
    command = [sys.executable, "-m", "tierkv", "vault", "--config", str(config)]
    command += ["--listen", "127.0.0.1:0", "--disk-dir", str(disk_dir)]
    second = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert second.returncode == 1
    assert f"is in use by another vault (pid {vault.process.pid})" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    put_all(vault.address, range(4))  # the first vault is unharmed
    assert len(read_back(vault.address, 4)) == 4


@pytest.mark.parametrize("magic", [b"TKVR", b"TKV2"])
def test_a_record_planted_in_a_write_that_met_a_full_disk_is_never_recovered(
    vault_factory: Callable[..., VaultHandle], disk_dir: Path, tmp_path: Path, magic: bytes
) -> None:
    """Tenant bob's block holds a CLEAR of alice's namespace and a whole record of it; its
    write meets a full disk, the vault stops cleanly and starts again: alice gets a miss for
    the planted block, never bob's bytes, and keeps every block of her own."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    tokens.chmod(0o600)
    config = f'[security]\ntoken_file = "{tokens}"\n'
    args = ["--disk-dir", str(disk_dir)]
    full = 2 * MIB  # alice's 1 MiB fits, bob's 3 MiB does not
    vault = vault_factory(
        "64MiB", subprocess=True, args=args, config=config, token=ALICE, file_size_limit=full
    )
    alices = b"alice/" + NS
    planted = forged_record(KIND_CLEAR, alices, b"", b"", magic)
    planted += forged_record(KIND_BLOCK, alices, key(9), b"forged by bob" * 50, magic)
    carrier = b"x" * 1000 + planted + b"y" * (3 * MIB)  # cut by the full disk after `planted`
    with VaultClient(vault.address, token=ALICE) as alice:
        for i in range(4):
            alice.put(NS, key(i), 0, payload(i))
        assert alice.flush(timeout=30) and alice.stored_puts == 4
    with VaultClient(vault.address, token=BOB) as bob:
        bob.put(NS, key(1), 0, carrier)
        bob.flush(timeout=30)
        assert (bob.stored_puts, bob.rejected_puts) == (0, 1)  # the disk did not take it
    vault.stop()
    assert "cannot write" in log_of(vault)
    again = vault_factory("64MiB", subprocess=True, args=args, config=config, token=ALICE)
    with VaultClient(again.address, token=ALICE, deadline_s=30) as alice:
        found = alice.promote(NS, [key(i) for i in (0, 1, 2, 3, 9)], [0])
        assert alice.checksum_failures == 0
    assert {index: bytes(data) for (index, _), data in found.items()} == {
        i: payload(i) for i in range(4)
    }
