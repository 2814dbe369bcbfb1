"""The file tier (tierkv/backends/file.py): real files under tmp_path, real codecs, real sealing,
and several processes writing and reading one directory at once."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tierkv.backends.file import HEADER_BYTES, FileTier, file_name
from tierkv.checksum import block_checksum
from tierkv.config import ConfigError, config_from_mapping
from tierkv.keys import chain_block_keys, namespace_fingerprint
from tierkv.seal import new_data_key_line
from tierkv.tier import ColdTier

NS = namespace_fingerprint({"test": "file tier"})
OTHER_MODEL = namespace_fingerprint({"test": "another model"})
KEYS = chain_block_keys(list(range(16 * 32)), block_tokens=32)
SHAPE = (2, 32, 2, 64)


def key_file(directory: Path, name: str) -> Path:
    path = directory / name
    path.write_text(new_data_key_line(1))
    path.chmod(0o600)
    return path


def blocks(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE).astype(np.float16) for _ in range(count)]


def url(root: Path, tenant: str = "alice", cap: str | None = None) -> str:
    return f"file://{root}?tenant={tenant}" + (f"&max_bytes={cap}" if cap else "")


def file_tier(
    root: Path, keys: Path | None, tenant: str = "alice", codec: str = "none"
) -> ColdTier:
    mapping: dict[str, dict[str, object]] = {"cluster": {"kv_cold": url(root, tenant)}}
    if codec != "none":
        mapping["compression"] = {"enabled": True, "codec": codec, "group_size": 64}
    if keys is not None:
        mapping["security"] = {"data_key_file": str(keys)}
    return ColdTier.from_config(config_from_mapping(mapping, "test"), warm_dtypes=())


def store(tier: ColdTier, data: list[np.ndarray], namespace: bytes = NS) -> None:
    for index, block in enumerate(data):
        tier.store(namespace, KEYS[index], 0, block.copy())
    assert tier.flush(timeout=30)


def load(
    tier: ColdTier, data: list[np.ndarray], namespace: bytes = NS
) -> tuple[set[int], list[np.ndarray]]:
    outs = [np.zeros_like(block) for block in data]
    failed = tier.load(namespace, KEYS[: len(data)], {"kv": [0]}, lambda i, part: outs[i])
    return failed, outs


@pytest.fixture
def root(tmp_path: Path) -> Path:
    directory = tmp_path / "kv"
    directory.mkdir(mode=0o700)
    return directory


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_sealed_blocks_round_trip_in_private_files_at_tenant_and_model(
    root: Path, tmp_path: Path, codec: str
) -> None:
    tier = file_tier(root, key_file(tmp_path, "alice.keys"), codec=codec)
    try:
        data = blocks(4)
        store(tier, data)
        assert tier.lookup(NS, KEYS[:5], {"kv": [0]}) == 4
        failed, outs = load(tier, data)
        assert failed == set()
        for block, out in zip(data, outs, strict=True):
            if codec == "none":
                assert np.array_equal(block, out)
            else:
                assert np.allclose(block, out, atol=0.1)
        assert tier.stats()["sealed_blocks"] == 4 and tier.stats()["open_failures"] == 0
    finally:
        tier.close()
    space = root / "alice" / NS.hex()
    files = sorted(space.iterdir())
    assert [f.name for f in files] == sorted(file_name(k, 0) for k in KEYS[:4])
    for path in (root / "alice", space):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert data[0].tobytes()[:64] not in path.read_bytes()  # sealed: not in the clear


def test_without_a_data_key_blocks_are_stored_as_on_redis(root: Path) -> None:
    """As for Valkey / Redis, a file tier may run unsealed (status shows it: no "seal")."""
    tier = file_tier(root, None)
    try:
        data = blocks(3)
        store(tier, data)
        failed, outs = load(tier, data)
        assert failed == set()
        assert all(np.array_equal(a, b) for a, b in zip(data, outs, strict=True))
    finally:
        tier.close()


def _restore_in_new_process(root: str, keys: str, count: int, queue: multiprocessing.Queue) -> None:
    tier = file_tier(Path(root), Path(keys))
    try:
        data = blocks(count)
        failed, outs = load(tier, data)
        same = all(np.array_equal(a, b) for a, b in zip(data, outs, strict=True))
        queue.put((sorted(failed), same, tier.lookup(NS, KEYS, {"kv": [0]})))
    finally:
        tier.close()


def test_a_restart_in_a_new_process_keeps_every_block(root: Path, tmp_path: Path) -> None:
    keys = key_file(tmp_path, "alice.keys")
    writer = file_tier(root, keys)
    store(writer, blocks(6))
    writer.close()
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    process = spawn.Process(target=_restore_in_new_process, args=(str(root), str(keys), 6, queue))
    process.start()
    failed, same, hit = queue.get(timeout=120)
    process.join(30)
    assert (failed, same, hit) == ([], True, 6)


def test_a_moved_block_does_not_open(root: Path, tmp_path: Path) -> None:
    """Renamed to another key, copied to another model's or tenant's directory, with or without
    a checksum made for its new place: a counted miss, never another block's data."""
    alice = file_tier(root, key_file(tmp_path, "alice.keys"))
    bob = file_tier(root, key_file(tmp_path, "bob.keys"), tenant="bob")
    try:
        data = blocks(2)
        store(alice, data)
        space = root / "alice" / NS.hex()
        first = (space / file_name(KEYS[0], 0)).read_bytes()
        # key 1 now holds key 0's file, its checksum remade for key 1 (a forger's best)
        payload = first[HEADER_BYTES:]
        forged = bytearray(first)
        forged[16:24] = block_checksum(NS, KEYS[1], 0, payload).to_bytes(8, "little")
        (space / file_name(KEYS[1], 0)).write_bytes(forged)
        failed, _ = load(alice, data)
        assert failed == {1} and alice.stats()["open_failures"] == 1
        # another model's directory of the same tenant, checksum remade: does not open
        other = root / "alice" / OTHER_MODEL.hex()
        other.mkdir(mode=0o700)
        forged[16:24] = block_checksum(OTHER_MODEL, KEYS[0], 0, payload).to_bytes(8, "little")
        (other / file_name(KEYS[0], 0)).write_bytes(forged)
        failed, _ = load(alice, data[:1], namespace=OTHER_MODEL)
        assert failed == {0} and alice.stats()["open_failures"] == 2
        # bob's directory: his data key does not open alice's block
        bobs = root / "bob" / NS.hex()
        bobs.mkdir(mode=0o700)
        (bobs / file_name(KEYS[0], 0)).write_bytes(first)
        assert bob.lookup(NS, KEYS[:1], {"kv": [0]}) == 1
        failed, _ = load(bob, data[:1])
        assert failed == {0} and bob.stats()["open_failures"] == 1
    finally:
        alice.close()
        bob.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_a_damaged_file_is_a_miss_and_removed(root: Path, damage: str) -> None:
    tier = file_tier(root, None)
    try:
        data = blocks(3)
        store(tier, data)
        path = root / "alice" / NS.hex() / file_name(KEYS[1], 0)
        raw = bytearray(path.read_bytes())
        if damage == "truncate":
            raw = raw[: len(raw) // 2]
        elif damage == "flip":
            raw[-5] ^= 0xFF
        elif damage == "empty":
            raw = bytearray()
        else:
            raw = bytearray(os.urandom(len(raw)))
        path.write_bytes(raw)
        failed, outs = load(tier, data)
        assert failed == {1}
        assert np.array_equal(outs[0], data[0]) and np.array_equal(outs[2], data[2])
        assert not path.exists()
        assert tier.lookup(NS, KEYS[:3], {"kv": [0]}) == 1
    finally:
        tier.close()


def test_the_cap_holds_and_the_oldest_blocks_go(root: Path) -> None:
    backend = FileTier.from_url(url(root, cap="1MiB"), config_from_mapping({}, "t").client)
    payload = os.urandom(100 * 1024)
    try:
        for index, key in enumerate(KEYS):
            backend.put(NS, key, 0, payload)
            assert backend.flush(timeout=10)
            time.sleep(0.01)  # distinct write times
            held = sum(p.stat().st_size for p in (root / "alice" / NS.hex()).iterdir())
            assert held <= 1024 * 1024, f"{held} bytes after {index + 1} blocks"
        assert backend.evictions > 0
        present = {p.name for p in (root / "alice" / NS.hex()).iterdir()}
        assert file_name(KEYS[-1], 0) in present and file_name(KEYS[0], 0) not in present
        stats = backend.server_stats()[0]
        assert stats.max_bytes == 1024 * 1024 and 0 < stats.bytes_used <= stats.max_bytes
    finally:
        backend.close()


ROUNDS = 6
"""Versions of each block a writer writes, in turn, until told to stop."""


def _writer(root: str, seed: int, ready: multiprocessing.Queue, stop: object) -> None:
    """Writes KEYS[:8], part 0, again and again with payloads only this writer writes."""
    backend = FileTier.from_url(url(Path(root)), config_from_mapping({}, "t").client)
    ready.put(True)
    try:
        version = 0
        while not stop.is_set() or version < ROUNDS:  # type: ignore[attr-defined]
            for index, key in enumerate(KEYS[:8]):
                backend.put(NS, key, 0, writer_payload(seed, index, version % ROUNDS))
            backend.flush(timeout=30)
            version += 1
    finally:
        backend.close()


def writer_payload(seed: int, index: int, version: int) -> bytes:
    size = 200_000 + 4096 * index + seed  # not a whole number of pages
    return np.random.default_rng([seed, index, version]).bytes(size)


def _reader(
    root: str, ready: multiprocessing.Queue, stop: object, out: multiprocessing.Queue
) -> None:
    backend = FileTier.from_url(url(Path(root)), config_from_mapping({}, "t").client)
    versions = {
        (seed, index): {writer_payload(seed, index, v) for v in range(ROUNDS)}
        for seed in (1, 2, 3)
        for index in range(8)
    }
    seen = torn = 0
    ready.put(True)
    try:
        while not stop.is_set() or not seen:  # type: ignore[attr-defined]
            found = backend.promote(NS, KEYS[:8], [0])
            for (index, _), payload in found.items():
                seen += 1
                seed = (len(payload) - 200_000 - 4096 * index) % 4096
                torn += bytes(payload) not in versions.get((seed, index), ())
        out.put((seen, torn, backend.corrupt))
    finally:
        backend.close()


def test_concurrent_writers_and_readers_never_see_a_torn_block(root: Path) -> None:
    """Three writer processes rewrite the same blocks while two reader processes read them: a
    reader gets some writer's whole block or a miss, never a mix or a part."""
    FileTier.from_url(url(root), config_from_mapping({}, "t").client).close()  # makes the tenant
    spawn = multiprocessing.get_context("spawn")
    ready, out, stop = spawn.Queue(), spawn.Queue(), spawn.Event()
    readers = [spawn.Process(target=_reader, args=(str(root), ready, stop, out)) for _ in "ab"]
    writers = [
        spawn.Process(target=_writer, args=(str(root), seed, ready, stop)) for seed in (1, 2, 3)
    ]
    for process in readers + writers:
        process.start()
    for _ in readers + writers:
        ready.get(timeout=120)
    time.sleep(3)  # all of them rewrite and read the blocks for a few seconds
    stop.set()
    for process in writers:
        process.join(60)
        assert process.exitcode == 0
    results = [out.get(timeout=60) for _ in readers]
    for process in readers:
        process.join(30)
    assert all(torn == 0 and corrupt == 0 for _, torn, corrupt in results), results
    assert all(seen > 0 for seen, _, _ in results)
    assert not [p for p in (root / "alice" / NS.hex()).iterdir() if p.name.startswith(".")]


def test_a_directory_others_may_read_or_write_is_refused(root: Path) -> None:
    client = config_from_mapping({}, "t").client
    root.chmod(0o755)
    with pytest.raises(ConfigError, match=re.escape(f"file tier {root}: group or others may read")):
        FileTier.from_url(url(root), client)
    root.chmod(0o711)  # searchable: tenants of other users reach their own directories
    FileTier.from_url(url(root), client).close()
    (root / "alice").chmod(0o750)
    with pytest.raises(ConfigError, match=re.escape(f"file tier {root / 'alice'}: open to group")):
        FileTier.from_url(url(root), client)
    with pytest.raises(ConfigError, match=r"file tier .*missing: No such file"):
        FileTier.from_url(url(root / "missing"), client)


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("file://kv", "expected file:///absolute/path"),
        ("file:///kv?tenant=a&tenant=b", "unknown or repeated option"),
        ("file:///kv?ttl=3", "unknown or repeated option \\['ttl'\\]"),
        ("file:///kv?max_bytes=12kb", "expected at least 1MiB"),
        ("file:///kv?max_bytes=lots", "expected a size like"),
    ],
)
def test_bad_file_urls_are_refused_naming_them(address: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"cluster.kv_cold: .*{message}"):
        config_from_mapping({"cluster": {"kv_cold": address}}, "test")


def test_a_bad_tenant_is_refused(root: Path) -> None:
    with pytest.raises(ConfigError, match=r"file tier tenant '\.\.'"):
        FileTier.from_url(url(root, tenant=".."), config_from_mapping({}, "t").client)


@pytest.mark.parametrize("where", ["tmp_path", "/dev/shm", "buffered"])
def test_reads_say_their_mode_and_work_in_it(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """O_DIRECT where the filesystem opens files with it (ext4, tmpfs since Linux 6.6), else
    buffered; the start-up log line says which. Payloads of any length come back whole."""
    base = Path("/dev/shm") if where == "/dev/shm" else tmp_path
    if not base.is_dir():
        pytest.skip(f"no {base}")
    root = base / f"tierkv-test-{os.getpid()}"
    root.mkdir(mode=0o700)
    try:
        with caplog.at_level("INFO", logger="tierkv"):
            backend = FileTier(root, "alice", direct=where != "buffered")
        assert backend.read_mode in ("O_DIRECT", "buffered")
        assert f"file tier {root / 'alice'}: reads {backend.read_mode}" in caplog.text
        if where == "buffered":
            assert backend.read_mode == "buffered"
        try:
            payloads = [os.urandom(size) for size in (1, 4096 - 64, 3 * 4096 + 17, 9 << 20)]
            for key, payload in zip(KEYS, payloads, strict=False):
                backend.put(NS, key, 0, payload)
            assert backend.flush(timeout=30)
            found = backend.promote(NS, KEYS[:5], [0])
            assert sorted(found) == [(i, 0) for i in range(4)]
            assert [bytes(found[(i, 0)]) for i in range(4)] == payloads
        finally:
            backend.close()
    finally:
        shutil.rmtree(root)


def test_status_shows_the_file_tier_with_its_bytes_and_cap(root: Path) -> None:
    from typer.testing import CliRunner

    from tierkv.cli import app

    backend = FileTier.from_url(url(root, cap="4MiB"), config_from_mapping({}, "t").client)
    backend.put(NS, KEYS[0], 0, os.urandom(100_000))
    assert backend.flush(timeout=10)
    backend.close()
    runner = CliRunner(env={"COLUMNS": "200"})
    result = runner.invoke(app, ["status", "--json", "--vault", url(root, cap="4MiB")])
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    row = next(rows for title, rows in found.items() if title != "totals")[0]
    assert row["verdict"] == "up" and row["role"].startswith("file (")
    assert row["disk"]["max_bytes"] == 4 * 1024 * 1024
    assert row["disk"]["bytes_used"] == 100_000 + HEADER_BYTES and row["entries"] == 1
    table = runner.invoke(app, ["status", "--wide", "--vault", url(root, cap="4MiB")])
    assert "4.0 MiB" in table.stdout and "n/a (file)" in table.stdout, table.stdout
    root.chmod(0o755)
    down = runner.invoke(app, ["status", "--vault", url(root)])
    assert down.exit_code == 1 and "group or others may read or write it" in down.output


def test_the_benchmark_runs_and_prints_the_restore_beside_the_bare_read(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_file_tier.py"
    command = [sys.executable, str(script), "--dir", str(tmp_path), "--total", "8MiB"]
    result = subprocess.run(
        [*command, "--block", "1MiB", "--rounds", "1"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for row in ("memcpy", "bare read, 1 thread", "restore (Lookup + Promote)", "sealed load"):
        assert row in result.stdout
    assert "restore ÷ bare read:" in result.stdout
    assert list(tmp_path.iterdir()) == []  # its directory is removed


def test_clear_removes_a_namespace_but_not_a_write_in_progress(root: Path) -> None:
    backend = FileTier.from_url(url(root), config_from_mapping({}, "t").client)
    try:
        for key in KEYS[:3]:
            backend.put(NS, key, 0, b"block")
        backend.put(OTHER_MODEL, KEYS[0], 0, b"other model")
        assert backend.flush(timeout=10)
        in_progress = root / "alice" / NS.hex() / ".writing.tmp"
        in_progress.write_bytes(b"half")
        assert backend.clear(NS) == 3
        assert backend.lookup(NS, KEYS[:1], [0]) == 0 and in_progress.exists()
        assert backend.lookup(OTHER_MODEL, KEYS[:1], [0]) == 1
    finally:
        backend.close()


CAP = 1024 * 1024
BLOCK = 100 * 1024


def held_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "alice" / NS.hex()).iterdir())


def _capped_writer(root: str, first: int) -> None:
    backend = FileTier.from_url(url(Path(root), cap="1MiB"), config_from_mapping({}, "t").client)
    try:
        for key in KEYS[first : first + 8]:
            backend.put(NS, key, 0, os.urandom(BLOCK))
            backend.flush(timeout=30)
    finally:
        backend.close()


def test_the_cap_holds_with_two_engines_writing_at_once(root: Path) -> None:
    """Each engine counts the other's files at its next scan, which comes before it wrote an
    eighth of the cap: the directory passes the cap by at most that eighth."""
    spawn = multiprocessing.get_context("spawn")
    writers = [spawn.Process(target=_capped_writer, args=(str(root), first)) for first in (0, 8)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(120)
        assert process.exitcode == 0
    assert 0 < held_bytes(root) <= CAP * 9 // 8


@pytest.mark.parametrize("order", ["in turn", "one after the other"])
def test_engines_that_opened_an_empty_directory_see_each_others_writes(
    root: Path, order: str
) -> None:
    """Both engines scan the empty directory when they open it; neither's own writes (8 blocks)
    pass the 10-block cap, so only a scan before the cap counts the other's (the two-process
    test above saw 16 blocks kept when the engines started together)."""
    client = config_from_mapping({}, "t").client
    engines = [FileTier.from_url(url(root, cap="1MiB"), client) for _ in range(2)]
    first, second = (
        [(engine, key) for key in keys]
        for engine, keys in ((engines[0], KEYS[:8]), (engines[1], KEYS[8:16]))
    )
    if order == "in turn":
        writes = [write for pair in zip(first, second, strict=True) for write in pair]
    else:
        writes = first + second
    try:
        for engine, key in writes:
            engine.put(NS, key, 0, os.urandom(BLOCK))
            assert engine.flush(timeout=30)
            assert held_bytes(root) <= CAP * 9 // 8
    finally:
        for engine in engines:
            engine.close()
