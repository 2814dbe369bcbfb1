"""DiskTier alone: write and read back, restart, torn tails, damaged bytes, the cap, the lock."""

from __future__ import annotations

import os
import random
import resource
import signal
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import xxhash
from helpers import key, wait_until

from tierkv.backends.vault import VaultClient
from tierkv.checksum import block_checksum
from tierkv.sizes import MIB
from tierkv.vault.auth import namespace_tenant
from tierkv.vault.disk import INDEX_BYTES_PER_BLOCK, DiskLockedError, DiskTier
from tierkv.vault.server import serve
from tierkv.vault.store import VaultStore, entry_bytes

NS = b"n" * 16


def payload(i: int, size: int = 1000) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def write(disk: DiskTier, i: int, size: int = 1000, part: int = 0) -> None:
    data = payload(i, size)
    disk.write(NS, key(i), part, data, block_checksum(NS, key(i), part, data))


def hold_writer(
    disk: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, threading.Event]:
    """Hold the disk's writer at each batch until the first event is set; the second is set
    once the writer has taken a batch and waits."""
    gate, taken = threading.Event(), threading.Event()
    append = disk._append

    def held_back(batch: list[Any]) -> None:
        taken.set()
        gate.wait(60)
        append(batch)

    monkeypatch.setattr(disk, "_append", held_back)
    return gate, taken


def read(disk: DiskTier, indices: list[int], part: int = 0) -> list[bytes | None]:
    found = disk.read_many(NS, [(key(i), part) for i in indices])
    return [None if f is None else bytes(f[0]) for f in found]


def test_written_blocks_read_back_and_survive_a_restart(disk_dir: Path) -> None:
    disk = DiskTier(disk_dir, 64 * MIB, "always")
    for i in range(50):
        write(disk, i, 1000 + i)
    assert read(disk, [3, 99, 7]) == [payload(3, 1003), None, payload(7, 1007)]
    assert disk.close(timeout=30) == 0
    disk = DiskTier(disk_dir, 64 * MIB)
    assert (disk.recovery.blocks, disk.recovery.damaged) == (50, [])
    assert disk.recovery.payload_bytes == sum(1000 + i for i in range(50))
    assert read(disk, list(range(50))) == [payload(i, 1000 + i) for i in range(50)]
    disk.close()


def test_deletes_and_clears_stay_deleted_after_a_restart(disk_dir: Path) -> None:
    disk = DiskTier(disk_dir, 64 * MIB)
    for i in range(6):
        write(disk, i)
        write(disk, i, part=1)
    assert len(disk.delete(NS, [key(1)])) == 2
    write(disk, 1)  # stored again after the delete: must come back
    other = b"o" * 16
    data = payload(9)
    disk.write(other, key(9), 0, data, block_checksum(other, key(9), 0, data))
    disk.close(timeout=30)
    disk = DiskTier(disk_dir, 64 * MIB)
    assert read(disk, [0, 1, 2]) == [payload(0), payload(1), payload(2)]
    assert read(disk, [1], part=1) == [None]
    assert len(disk.clear(NS)) == 11
    disk.close(timeout=30)
    disk = DiskTier(disk_dir, 64 * MIB)
    assert read(disk, list(range(6))) == [None] * 6
    assert disk.read_many(other, [(key(9), 0)])[0] is not None
    disk.close()


def test_a_torn_tail_is_truncated_reported_and_never_served(disk_dir: Path) -> None:
    disk = DiskTier(disk_dir, 64 * MIB)
    for i in range(10):
        write(disk, i)
    disk.close(timeout=30)
    [segment] = disk_dir.glob("*.seg")
    size = segment.stat().st_size
    os.truncate(segment, size - 10)  # the last record lost its last 10 bytes
    disk = DiskTier(disk_dir, 64 * MIB)
    assert disk.recovery.blocks == 9
    [problem] = disk.recovery.damaged
    assert "torn tail" in problem and segment.name in problem
    assert read(disk, list(range(10))) == [payload(i) for i in range(9)] + [None]
    write(disk, 10)  # a new segment; the old one keeps its 9 records
    disk.close(timeout=30)
    disk = DiskTier(disk_dir, 64 * MIB)
    assert (disk.recovery.blocks, disk.recovery.damaged) == (10, [])
    disk.close()


def ten_blocks_with_a_flipped_byte(disk_dir: Path, from_payload_4: int) -> DiskTier:
    """A restarted tier of blocks 0-9 after one byte, `from_payload_4` bytes from the start of
    block 4's payload, was flipped on disk."""
    disk = DiskTier(disk_dir, 64 * MIB)
    for i in range(10):
        write(disk, i)
    disk.close(timeout=30)
    [segment] = disk_dir.glob("*.seg")
    with segment.open("r+b") as f:
        data = f.read()
        at = data.index(payload(4)) + from_payload_4
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    return DiskTier(disk_dir, 64 * MIB)


def test_a_damaged_payload_byte_is_a_miss_for_that_block_only(disk_dir: Path) -> None:
    disk = ten_blocks_with_a_flipped_byte(disk_dir, 500)
    expected = [None if i == 4 else payload(i) for i in range(10)]
    assert read(disk, list(range(10))) == expected
    assert disk.stats().corrupt == 1
    assert disk.stats().entries == 9
    disk.close()


def test_a_damaged_header_skips_that_record_only(disk_dir: Path) -> None:
    disk = ten_blocks_with_a_flipped_byte(disk_dir, -30)  # inside record 4's header
    [problem] = disk.recovery.damaged
    assert "skipped" in problem
    assert read(disk, list(range(10))) == [None if i == 4 else payload(i) for i in range(10)]
    disk.close()


def test_the_cap_drops_the_oldest_segments(disk_dir: Path) -> None:
    cap = 8 * MIB  # segments of 1 MiB
    disk = DiskTier(disk_dir, cap, "never")
    for i in range(100):
        write(disk, i, 256 * 1024)
        disk.wait_for_room()
        assert disk.stats().bytes_used <= cap
    disk.close(timeout=30)
    assert sum(p.stat().st_size for p in disk_dir.glob("*.seg")) <= cap
    disk = DiskTier(disk_dir, cap)
    found = read(disk, list(range(100)))
    kept = [i for i, f in enumerate(found) if f is not None]
    assert 20 <= len(kept) < 32 and kept == list(range(100 - len(kept), 100))
    assert all(found[i] == payload(i, 256 * 1024) for i in kept)
    disk.close()


def test_the_index_cap_bounds_the_blocks_indexed_also_after_a_restart(disk_dir: Path) -> None:
    """Tiny blocks: the disk's byte cap would let millions in, each costing index RAM; the index
    cap drops the oldest segments (of at most an eighth of the blocks each) instead."""
    index_cap = 400 * INDEX_BYTES_PER_BLOCK
    disk = DiskTier(disk_dir, 64 * MIB, "never", max_index_bytes=index_cap)
    assert disk.max_blocks == 400
    for i in range(3000):
        write(disk, i, 8)
        if i % 100 == 99:
            written(disk)
            assert disk.stats().entries <= 400 and disk.index_bytes <= index_cap
    written(disk)
    newest = read(disk, list(range(2990, 3000)))
    assert newest == [payload(i, 8) for i in range(2990, 3000)]
    assert 300 <= disk.stats().entries <= 400  # an eighth at a time goes, never all
    disk.close(timeout=30)
    smaller = DiskTier(disk_dir, 64 * MIB, max_index_bytes=100 * INDEX_BYTES_PER_BLOCK)
    assert smaller.recovery.blocks <= 100 and read(smaller, [2999]) == [payload(2999, 8)]
    smaller.close()


def test_the_disk_index_counts_against_the_ram_cap(disk_dir: Path) -> None:
    cap = 4 * MIB
    disk = DiskTier(disk_dir, 64 * MIB, "never", max_index_bytes=cap // 4)
    store = VaultStore(cap, disk=disk)
    for i in range(5000):
        data = payload(i, 8)
        store.put(NS, key(i), 0, data, block_checksum(NS, key(i), 0, data))
    written(disk)
    ram = store.stats()
    assert 0 < disk.index_bytes <= cap // 4
    assert ram.bytes_used + disk.index_bytes <= cap
    store.close(timeout=30)


def written(disk: DiskTier) -> None:
    """Wait until the writer has written everything queued so far."""
    assert disk.wait_written(disk.mark(), timeout=60)


def test_eviction_keeps_a_block_read_since_written_and_drops_the_cold_ones(
    disk_dir: Path,
) -> None:
    cap = 8 * MIB  # segments of 1 MiB: five blocks of 200 KiB each
    size = 200 * 1024
    disk = DiskTier(disk_dir, cap, "never")
    for i in range(5):
        write(disk, i, size)
    written(disk)
    assert read(disk, [2]) == [payload(2, size)]  # the only one of segment 1 read
    i = 5
    while disk.stats().evictions < 4:  # until segment 1 is dropped
        write(disk, i, size)
        written(disk)
        i += 1
    assert read(disk, [0, 1, 2, 3, 4]) == [None, None, payload(2, size), None, None]
    stats = disk.stats()
    assert (stats.evictions, stats.kept) == (4, 1) and stats.bytes_used <= cap
    disk.close(timeout=30)
    disk = DiskTier(disk_dir, cap, "never")  # the copy is on disk: it survives a restart
    assert disk.has(NS, key(2), [0])  # (has() does not count as a read)
    first_new = i  # written after the copy of 2: goes after it
    while i == first_new or disk.has(NS, key(first_new), [0]):  # a pass; 2 not read again
        write(disk, i, size)
        written(disk)
        i += 1
    assert read(disk, [2]) == [None]
    disk.close()


def test_a_block_the_ram_tier_serves_is_kept_on_disk_too(tmp_path: Path) -> None:
    size = 200 * 1024
    disk = DiskTier(tmp_path / "disk", 8 * MIB, "never")
    store = VaultStore(max_bytes=3 * entry_bytes(NS, key(0), size), disk=disk)  # 3 in RAM
    keys = [key(i) for i in range(60)]

    def put(i: int) -> None:
        data = payload(i, size)
        assert store.put(NS, keys[i], 0, data, block_checksum(NS, keys[i], 0, data)) is None

    for i in range(5):
        put(i)
    assert store.wait_durable(0)  # a block counts as read once it is on disk
    assert [b.key_index for b in store.get_many(NS, [keys[0], keys[3]], [0])] == [0, 1]
    assert store.stats().ram_hits == 1  # 3 from RAM (2, 3 and 4 are there), 0 from disk
    for i in range(5, 60):  # 11 MiB through an 8 MiB disk: segment 1 goes
        put(i)
        assert store.wait_durable(0)
    disk_stats = store.stats().disk
    assert disk_stats is not None and disk_stats.evictions > 0 and disk_stats.kept == 2
    found = store.get_many(NS, keys[:5], [0])
    assert [(b.key_index, bytes(b.payload)) for b in found] == [
        (0, payload(0, size)),
        (3, payload(3, size)),
    ]
    store.close(timeout=30)


def test_a_put_is_acknowledged_only_once_the_disk_wrote_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fsync says, an acknowledged block is in its segment file (the page cache), so
    a crash of the vault process cannot lose it; here the writer is held back."""
    disk = DiskTier(tmp_path / "disk", 128 * MIB, "never")
    gate, _ = hold_writer(disk, monkeypatch)
    blocks = [payload(i, MIB) for i in range(1, 25)]  # two bulk frames, one gRPC stream
    try:
        for bulk_port, transport in ((0, "bulk"), (None, "grpc")):
            server = serve("127.0.0.1:0", 0, bulk_port=bulk_port, disk=disk)
            try:
                with VaultClient(server.address, deadline_s=60) as client:
                    for i, data in enumerate(blocks):
                        client.put(NS, key(i), 0, data)
                    assert not client.flush(timeout=1.0)  # not acknowledged: not yet written
                    assert client.stored_puts == 0
                    gate.set()
                    assert client.flush(timeout=60) and client.stored_puts == len(blocks)
                    assert client.transport == transport
                segments = b"".join(p.read_bytes() for p in (tmp_path / "disk").glob("*.seg"))
                assert all(segments.count(data) == 1 + (transport == "grpc") for data in blocks)
            finally:
                gate.clear()
                server.stop(grace=0)
    finally:
        gate.set()
        disk.close(timeout=30)


def test_reads_of_adjacent_blocks_coalesce_and_keep_request_order(disk_dir: Path) -> None:
    disk = DiskTier(disk_dir, 64 * MIB)
    for i in range(40):
        for part in (0, 1):
            write(disk, i, 3000 + i, part)
    disk.close(timeout=30)
    disk = DiskTier(disk_dir, 64 * MIB)
    wanted = [(key(i), part) for i in reversed(range(40)) for part in (1, 0)]
    found = disk.read_many(NS, wanted)
    assert [bytes(f[0]) if f else None for f in found] == [
        payload(i, 3000 + i) for i in reversed(range(40)) for _ in (1, 0)
    ]
    disk.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_reads_keep_no_file_descriptor_open(disk_dir: Path) -> None:
    disk = DiskTier(disk_dir, 64 * MIB)
    for i in range(40):
        write(disk, i, 3000 + i)
    disk.close(timeout=30)
    disk = DiskTier(disk_dir, 64 * MIB)
    before = open_fds()
    for _ in range(3):
        found = disk.read_many(NS, [(key(i), 0) for i in range(40)])
        assert all(found)
    assert open_fds() == before  # (one fd per block read leaked: a vault ran out of them)
    disk.close()


def test_a_second_tier_on_the_same_directory_refuses(disk_dir: Path) -> None:
    disk = DiskTier(disk_dir, 64 * MIB)
    with pytest.raises(DiskLockedError, match=f"in use by another vault \\(pid {os.getpid()}\\)"):
        DiskTier(disk_dir, 64 * MIB)
    disk.close()
    DiskTier(disk_dir, 64 * MIB).close()


def test_a_store_with_a_disk_tier_spills_reads_through_and_keeps_request_order(
    tmp_path: Path,
) -> None:
    disk = DiskTier(tmp_path / "disk", 64 * MIB)
    store = VaultStore(max_bytes=3 * entry_bytes(NS, key(0), 1000), disk=disk)  # 3 entries
    for i in range(10):
        data = payload(i)
        assert store.put(NS, key(i), 0, data, block_checksum(NS, key(i), 0, data)) is None
    assert store.stats().entries == 3
    assert store.lookup(NS, [key(i) for i in range(11)], [0]) == 10
    found = store.get_many(NS, [key(i) for i in (9, 0, 42, 5)], [0])
    assert [(b.key_index, bytes(b.payload)) for b in found] == [
        (0, payload(9)),
        (1, payload(0)),
        (3, payload(5)),
    ]
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.disk_hits, stats.ram_hits) == (3, 1, 2, 1)
    assert stats.entries == 3 and stats.disk is not None and stats.disk.entries == 10
    assert store.delete(NS, [key(0), key(1)]) == 2
    assert store.lookup(NS, [key(1)], [0]) == 0
    assert store.close(timeout=30) == 0
    disk = DiskTier(tmp_path / "disk", 64 * MIB)
    assert disk.recovery.blocks == 8
    disk.close()


def test_a_failing_disk_write_is_logged_and_the_writer_keeps_going(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = DiskTier(tmp_path / "disk", 64 * MIB)
    [segment] = (tmp_path / "disk").glob("*.seg")
    read_only = os.open(segment, os.O_RDONLY)
    os.dup2(read_only, disk._fds[disk._active])  # writes now fail (EBADF), as on a dead disk
    os.close(read_only)
    write(disk, 1)
    wait_until(lambda: not disk.stats().queued_bytes, 60, interval=0.01)
    assert "cannot write" in caplog.text
    assert read(disk, [1]) == [None]  # never written: a miss, not a stall
    since = disk.mark()
    write(disk, 2)  # in a new segment: what the failed write left cannot be cut off this one
    assert disk.wait_written(disk.mark(), timeout=30, since=since)
    assert read(disk, [2]) == [payload(2)]
    assert disk.close(timeout=30) == 0


def test_a_put_whose_disk_write_fails_is_rejected_not_acknowledged(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk", 64 * MIB)
    [segment] = (tmp_path / "disk").glob("*.seg")
    read_only = os.open(segment, os.O_RDONLY)
    os.dup2(read_only, disk._fds[disk._active])  # writes now fail (EBADF), as on a full disk
    os.close(read_only)
    server = serve("127.0.0.1:0", 0, disk=disk)
    try:
        with VaultClient(server.address, deadline_s=60) as client:
            for i in range(3):
                client.put(NS, key(i), 0, payload(i))
            assert client.flush(timeout=60)
            assert (client.stored_puts, client.rejected_puts) == (0, 3)
            assert "the disk tier did not write the block" in client.last_rejections[0]
    finally:
        server.stop(grace=0)
        disk.close(timeout=30)


def forged_record(
    kind: int, namespace: bytes, block_key: bytes, data: bytes, magic: bytes
) -> bytes:
    """A whole record as a tenant could write it into a payload: a header of the given format
    (`magic`) with an unkeyed xxh3 header checksum (all a tenant can compute), then `data`."""
    checksum = block_checksum(namespace, block_key, 0, data) if data else 0
    sizes = (len(namespace), len(block_key), 0, len(data), checksum)
    fixed = struct.pack("<4sBxHHxxIQQ", magic, kind, *sizes)
    body = fixed + namespace + block_key
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + data


@pytest.mark.parametrize("magic", [b"TKVR", b"TKV2"])
def test_a_record_planted_in_a_payload_is_never_recovered(disk_dir: Path, magic: bytes) -> None:
    """Tenant B's payload holds a whole record of A's namespace and a CLEAR of A's namespace;
    after a cut inside B's record and a restart, A keeps its own blocks and gets none of B's."""
    victim, attacker = b"A" * 16, b"B" * 16
    disk = DiskTier(disk_dir, 64 * MIB)
    mine = payload(1)
    disk.write(victim, key(1), 0, mine, block_checksum(victim, key(1), 0, mine))
    planted = forged_record(0, victim, key(2), b"forged by B" * 50, magic)
    planted += forged_record(2, victim, b"", b"", magic)
    carrier = b"x" * 100 + planted + b"y" * 100
    disk.write(attacker, key(3), 0, carrier, block_checksum(attacker, key(3), 0, carrier))
    disk.close(timeout=30)
    [segment] = disk_dir.glob("*.seg")
    data = segment.read_bytes()
    os.truncate(segment, data.index(b"y" * 100) + 50)  # B's record cut after the planted ones
    disk = DiskTier(disk_dir, 64 * MIB)
    assert disk.read_many(victim, [(key(2), 0)]) == [None]
    found = disk.read_many(victim, [(key(1), 0)])[0]
    assert found is not None and bytes(found[0]) == mine
    assert disk.recovery.blocks == 1
    disk.close()


def test_a_block_the_disk_can_never_hold_is_rejected_not_acknowledged(tmp_path: Path) -> None:
    """A block larger than the disk tier's room was acknowledged, then left out of the disk
    without a word (gone after a kill -9): the store refuses it, with the reason."""
    disk = DiskTier(tmp_path / "disk", 16 * MIB, "always")
    store = VaultStore(max_bytes=64 * MIB, disk=disk)
    big = payload(1, 15 * MIB + MIB // 2)
    reason = store.put(NS, key(1), 0, big, block_checksum(NS, key(1), 0, big))
    assert reason is not None and "never fits the disk tier" in reason
    assert store.lookup(NS, [key(1)], [0]) == 0
    small = payload(2, MIB)
    assert store.put(NS, key(2), 0, small, block_checksum(NS, key(2), 0, small)) is None
    store.close(timeout=30)


def test_a_write_that_met_a_full_disk_leaves_no_record_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch cut short by a full disk (here RLIMIT_FSIZE, whose EFBIG a full disk's ENOSPC
    resembles) left its complete records behind the point the next write starts at: a shorter
    write then put an older, never acknowledged copy of a block after its acknowledged one,
    and the restart served the old copy."""
    victim, other = b"A" * 16, b"B" * 16
    disk = DiskTier(tmp_path / "disk", 64 * MIB, "never")
    gate, taken = hold_writer(disk, monkeypatch)
    write(disk, 0)  # the writer takes it alone and waits at the gate
    assert taken.wait(30)
    old, new, big = payload(1, 100), payload(2, 100), payload(3, 64 * 1024)
    since = disk.mark()
    disk.write(
        other, key(9), 0, payload(9, 4096), block_checksum(other, key(9), 0, payload(9, 4096))
    )
    disk.write(victim, key(1), 0, old, block_checksum(victim, key(1), 0, old))
    disk.write(other, key(8), 0, big, block_checksum(other, key(8), 0, big))
    [segment] = (tmp_path / "disk").glob("*.seg")
    limit = 1000 + 4096 + 100 + 32 * 1024 + 3 * 100  # mid-way through the big block's record
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        gate.set()
        assert not disk.wait_written(disk.mark(), timeout=30, since=since)  # the batch failed
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, ignored)
    assert segment.stat().st_size <= 1000 + 200  # only the first block's record is left
    since = disk.mark()
    disk.write(victim, key(1), 0, new, block_checksum(victim, key(1), 0, new))
    assert disk.wait_written(disk.mark(), timeout=30, since=since)
    disk.close()
    disk = DiskTier(tmp_path / "disk", 64 * MIB)
    found = disk.read_many(victim, [(key(1), 0)])[0]
    assert found is not None and bytes(found[0]) == new
    assert disk.recovery.damaged == []
    disk.close()


def test_a_clear_drops_queued_blocks_and_keeps_those_stored_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clear takes the namespace's queued blocks with it (the writer skips them), a block
    stored again after the clear is kept, live and after a restart, and other namespaces are
    untouched; the counts agree with what is left."""
    other = b"o" * 16
    disk = DiskTier(tmp_path / "disk", 64 * MIB, "never")
    for i in range(3):
        write(disk, i)
    data = payload(7)
    disk.write(other, key(7), 0, data, block_checksum(other, key(7), 0, data))
    assert disk.wait_written(disk.mark(), timeout=30)
    gate, _ = hold_writer(disk, monkeypatch)
    write(disk, 3)
    write(disk, 4)  # queued behind the gate
    cleared = disk.clear(NS)
    assert len(cleared) == 5 and (key(4), 0) in cleared and (key(0), 0) in cleared
    write(disk, 4, size=500)  # stored again after the clear
    assert read(disk, [0, 3, 4]) == [None, None, payload(4, 500)]
    gate.set()
    assert disk.wait_written(disk.mark(), timeout=30)
    assert read(disk, [0, 3, 4]) == [None, None, payload(4, 500)]
    stats = disk.stats()
    assert (stats.entries, stats.live_bytes, stats.queued_bytes) == (2, 1500, 0)
    disk.close()
    disk = DiskTier(tmp_path / "disk", 64 * MIB)
    assert read(disk, [0, 1, 2, 3, 4]) == [None] * 4 + [payload(4, 500)]
    assert disk.read_many(other, [(key(7), 0)])[0] is not None
    assert (disk.recovery.blocks, disk.recovery.payload_bytes) == (2, 1500)
    disk.close()


def test_no_record_of_the_first_format_is_read_after_a_resynchronisation(disk_dir: Path) -> None:
    """Recovery resynchronised inside a cut record at a copy of a real record (found by the
    fuzz), then went on along the chain from there and took a record of the first format that
    followed, which anyone can write, for one."""
    victim, attacker = b"A" * 16, b"B" * 16
    disk = DiskTier(disk_dir, 64 * MIB)
    mine = payload(1)
    disk.write(victim, key(1), 0, mine, block_checksum(victim, key(1), 0, mine))
    assert disk.wait_written(disk.mark(), timeout=30)
    [segment] = disk_dir.glob("*.seg")
    real = segment.read_bytes()
    planted = real + forged_record(0, victim, key(2), b"forged by B" * 50, b"TKVR")
    carrier = b"x" * 100 + planted + b"y" * 100
    disk.write(attacker, key(3), 0, carrier, block_checksum(attacker, key(3), 0, carrier))
    disk.close(timeout=30)
    os.truncate(segment, segment.read_bytes().index(b"y" * 100) + 50)
    disk = DiskTier(disk_dir, 64 * MIB)
    assert disk.read_many(victim, [(key(2), 0)]) == [None]
    found = disk.read_many(victim, [(key(1), 0)])[0]
    assert found is not None and bytes(found[0]) == mine
    disk.close()


def fail_next_write(monkeypatch: pytest.MonkeyPatch, after: int = 0) -> threading.Event:
    """The disk's next `os.pwritev` call but `after` fails with ENOSPC (a full disk); the event
    is set once it has."""
    import tierkv.vault.disk as disk_module

    failed = threading.Event()
    real = os.pwritev
    calls = [0]

    def pwritev(fd: int, buffers: Any, offset: int) -> int:
        calls[0] += 1
        if calls[0] == after + 1:
            failed.set()
            raise OSError(28, "No space left on device")
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk_module.os, "pwritev", pwritev)
    return failed


@pytest.mark.parametrize("removal", ["clear", "delete"])
def test_a_clear_or_delete_whose_record_failed_to_write_is_not_undone_by_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, removal: str
) -> None:
    """A Clear or Delete takes effect (and is answered) when it is queued; a write of its
    record that fails is tried again, else the restart brought the blocks back."""
    disk = DiskTier(tmp_path / "disk", 64 * MIB, "never")
    for i in range(3):
        write(disk, i)
    assert disk.wait_written(disk.mark(), timeout=30)
    failed = fail_next_write(monkeypatch)
    since = disk.mark()
    if removal == "clear":
        disk.clear(NS)
    else:
        disk.delete(NS, [key(i) for i in range(3)])
    assert not disk.wait_written(disk.mark(), timeout=30, since=since)  # that write failed
    assert failed.is_set() and not disk.has(NS, key(0), [0])
    assert disk.close(timeout=30) == 0  # the record is written before the tier closes
    disk = DiskTier(tmp_path / "disk", 64 * MIB)
    assert [disk.has(NS, key(i), [0]) for i in range(3)] == [False] * 3
    disk.close()


def test_a_batch_that_fails_after_its_first_piece_leaves_none_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch written in two pieces (it fills a segment, the rest goes to the next one) whose
    second piece fails: its Puts are refused, so the first piece's records must not come back
    at a restart either."""
    disk = DiskTier(tmp_path / "disk", 64 * MIB, "never", segment_bytes=MIB)
    gate, taken = hold_writer(disk, monkeypatch)
    write(disk, 0)  # the writer takes it alone and waits at the gate
    assert taken.wait(30)
    since = disk.mark()
    for i in range(1, 4):
        write(disk, i, 400 * 1024)  # 1.2 MiB: a second segment for the third block
    failed = fail_next_write(monkeypatch, after=2)  # block 0's batch, then the first piece
    gate.set()
    assert not disk.wait_written(disk.mark(), timeout=30, since=since)
    assert failed.is_set()
    assert read(disk, [1, 2, 3]) == [None] * 3
    disk.close()
    disk = DiskTier(tmp_path / "disk", 64 * MIB)
    assert read(disk, [0, 1, 2, 3]) == [payload(0), None, None, None]
    disk.close()


ALICES, BOBS = b"alice/" + NS, b"bob/" + NS


def write_as(disk: DiskTier, namespace: bytes, i: int, size: int = 1000) -> None:
    data = payload(i, size)
    disk.write(namespace, key(i), 0, data, block_checksum(namespace, key(i), 0, data))


def shared(directory: Path, cap: int = 64 * MIB, **options: Any) -> DiskTier:
    """A disk tier of a vault of several tenants ("TENANT/..." namespaces)."""
    disk = DiskTier(directory, cap, "never", **options)
    disk.share_by(namespace_tenant)
    return disk


def test_per_tenant_disk_counters_follow_replaces_deletes_clears_and_a_restart(
    tmp_path: Path,
) -> None:
    disk = shared(tmp_path / "disk")
    for i in range(5):
        write_as(disk, ALICES, i)
    for i in range(3):
        write_as(disk, BOBS, i, 500)
    write_as(disk, ALICES, 0, 2000)  # replaced: counted once, at its new size
    written(disk)
    assert (disk.held_by(b"alice"), disk.held_by(b"bob")) == ((5, 6000), (3, 1500))
    assert len(disk.delete(ALICES, [key(1), key(7)])) == 1
    disk.clear(BOBS)
    assert (disk.held_by(b"alice"), disk.held_by(b"bob")) == ((4, 5000), (0, 0))
    write_as(disk, BOBS, 9, 300)  # stored after the clear
    disk.close(timeout=30)
    again = shared(tmp_path / "disk")  # rebuilt from what recovery replayed
    assert (again.held_by(b"alice"), again.held_by(b"bob")) == ((4, 5000), (1, 300))
    again.clear(ALICES)
    assert again.held_by(b"alice") == (0, 0)
    again.close(timeout=30)


def test_a_tenant_within_its_disk_share_keeps_unread_blocks_through_anothers_flood(
    tmp_path: Path,
) -> None:
    """Alice holds a fifth of an 8 MiB disk and never reads; Bob writes 20 MiB. Alice's blocks
    are copied forward as their segments go, Bob's go; without `share_by` (one tenant) Alice's
    unread blocks would be the first to go."""
    size = 200 * 1024
    disk = shared(tmp_path / "disk", 8 * MIB)  # segments of 1 MiB; 7 MiB of room
    for i in range(8):
        write_as(disk, ALICES, i, size)
    for i in range(100):
        write_as(disk, BOBS, i, size)
        written(disk)
        assert disk.stats().bytes_used <= 8 * MIB
    alices = disk.read_many(ALICES, [(key(i), 0) for i in range(8)])
    assert [None if f is None else bytes(f[0]) for f in alices] == [
        payload(i, size) for i in range(8)
    ]
    stats = disk.stats()
    assert stats.evictions > 0 and stats.kept >= 8
    assert disk.held_by(b"bob")[1] <= 7 * MIB - 8 * size
    disk.close(timeout=30)


def test_tenants_all_within_their_share_still_make_room(tmp_path: Path) -> None:
    """Two tenants writing in turn hold about half each: the one holding the most gives way
    whenever neither is over its share, so making room never copies forever."""
    size = 200 * 1024
    disk = shared(tmp_path / "disk", 8 * MIB)
    for i in range(200):
        write_as(disk, ALICES if i % 2 else BOBS, i, size)
    written(disk)
    (_, alices), (_, bobs) = disk.held_by(b"alice"), disk.held_by(b"bob")
    assert disk.stats().bytes_used <= 8 * MIB and abs(alices - bobs) <= MIB
    assert disk.stats().kept < 200
    disk.close(timeout=30)


def test_a_tenant_within_its_share_of_the_index_keeps_its_blocks(tmp_path: Path) -> None:
    """Tiny blocks: the index cap (not the bytes) drops segments; Alice's 50 of 400 indexed
    blocks stay through Bob's 3000."""
    disk = shared(tmp_path / "disk", max_index_bytes=400 * INDEX_BYTES_PER_BLOCK)
    for i in range(50):
        write_as(disk, ALICES, i, 8)
    for i in range(3000):
        write_as(disk, BOBS, i, 8)
        if i % 100 == 99:
            written(disk)
            assert disk.stats().entries <= 400
    written(disk)
    assert disk.held_by(b"alice") == (50, 400)
    found = disk.read_many(ALICES, [(key(i), 0) for i in range(50)])
    assert [bytes(f[0]) for f in found if f is not None] == [payload(i, 8) for i in range(50)]
    disk.close(timeout=30)


def test_per_tenant_disk_counters_match_the_index_after_random_work_past_the_cap(
    tmp_path: Path,
) -> None:
    """Writes, replacements, deletes and clears of three tenants through a small disk (segments
    drop and blocks are copied forward): each tenant's counters equal a count of the index,
    live and after a restart."""
    rng = random.Random(55)
    namespaces = [tenant + b"/" + NS for tenant in (b"a", b"b", b"c")]
    disk = shared(tmp_path / "disk", 4 * MIB)

    def counted(tier: DiskTier) -> dict[bytes, tuple[int, int]]:
        found: dict[bytes, tuple[int, int]] = {}
        for namespace, space in tier._spaces.items():
            blocks, size = found.get(namespace_tenant(namespace), (0, 0))
            found[namespace_tenant(namespace)] = (
                blocks + len(space.index),
                size + sum(loc.length for loc in space.index.values()),
            )
        return {tenant: held for tenant, held in found.items() if held[0]}

    def held(tier: DiskTier) -> dict[bytes, tuple[int, int]]:
        every = {tenant: tier.held_by(tenant) for tenant in (b"a", b"b", b"c")}
        return {tenant: counts for tenant, counts in every.items() if counts[0]}

    for step in range(600):
        namespace = rng.choice(namespaces)
        roll = rng.random()
        if roll < 0.85:
            write_as(disk, namespace, rng.randrange(40), rng.randrange(1, 64 * 1024))
        elif roll < 0.97:
            disk.delete(namespace, [key(rng.randrange(40))])
        else:
            disk.clear(namespace)
        if step % 50 == 49:
            written(disk)
            assert held(disk) == counted(disk)
    written(disk)
    assert disk.stats().evictions > 0
    live = held(disk)
    assert live == counted(disk)
    disk.close(timeout=30)
    again = shared(tmp_path / "disk", 4 * MIB)
    assert held(again) == counted(again) == live
    again.close()
