"""A restore from the file tier beside a bare read of the same files and a memcpy, in one run.

    python benchmarks/bench_file_tier.py                       # 256 MiB in 2 MiB blocks, 3 rounds
    python benchmarks/bench_file_tier.py --dir /mnt/kv --total 1GiB

`--total` bytes of random payloads are stored through a file tier (tierkv/backends/file.py) in
a fresh directory under `--dir` (default: the system's temporary directory), then, each round:

- restore: the tier's Lookup and Promote of every block (one listing, every file opened, read
  the way the tier reads, O_DIRECT where the filesystem allows, and its checksum verified);
- bare read: the same files read the same way (O_DIRECT or buffered, as the tier chose) into
  one page-aligned buffer, no checksum, by 1 thread and by as many threads as the tier reads with;
- memcpy: numpy copies of the same number of bytes;
- sealed load: ColdTier.load of every block, sealed under a data key made for the run (open and
  lossless decode into the engine's arrays): what an engine's restore costs end to end.

The headline ratio is restore ÷ the faster bare read (target ≥ 0.8). Medians of the rounds,
each round running every measurement in turn.
O_DIRECT reads come from the device each time (no page cache); buffered ones may not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from tierkv.backends.file import PAGE_BYTES, READ_THREADS, FileTier, file_name
from tierkv.keys import chain_block_keys, namespace_fingerprint
from tierkv.quant import get_codec
from tierkv.seal import Sealer, new_data_key_line, read_data_keys
from tierkv.sizes import format_size, parse_size
from tierkv.tier import ColdTier

NAMESPACE = namespace_fingerprint({"bench": "file tier"})


def interleaved_gbps(
    total: int, rounds: int, runs: dict[str, Callable[[], object]]
) -> dict[str, float]:
    """Median GB/s of each of `runs`, each round running every one in turn (on a loaded machine
    a slow spell then hurts them all, not the one that happened to run in it)."""
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            figures[name].append(total / (time.perf_counter() - started) / 1e9)
    return {name: statistics.median(found) for name, found in figures.items()}


def bare_read(paths: list[Path], direct: bool, threads: int) -> Callable[[], None]:
    """Reading every file of `paths` whole into one page-aligned buffer, no checks."""
    sizes = [path.stat().st_size for path in paths]
    room = [-(-size // PAGE_BYTES) * PAGE_BYTES for size in sizes]
    raw = np.empty(sum(room) + PAGE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE_BYTES
    offsets = np.cumsum([start, *room[:-1]])
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def read_one(at: int) -> None:
        fd = os.open(paths[at], flags)
        try:
            offset = int(offsets[at])
            got = os.preadv(fd, [raw.data[offset : offset + room[at]]], 0)
            assert got == sizes[at]
        finally:
            os.close(fd)

    pool = ThreadPoolExecutor(threads)

    def run() -> None:
        if threads == 1:
            for at in range(len(paths)):
                read_one(at)
        else:
            list(pool.map(read_one, range(len(paths))))

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--total", default="256MiB")
    parser.add_argument("--block", default="2MiB")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    total, block = parse_size(args.total), parse_size(args.block)
    count = max(1, total // block)
    total = count * block
    keys = chain_block_keys(list(range(count)), block_tokens=1)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(block // 2).astype(np.float16) for _ in range(count)]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tierkv-bench-") as scratch:
        root = Path(scratch)
        root.chmod(0o700)
        backend = FileTier(root, "bench", max_bytes=4 * total + (1 << 30))
        try:
            for at, (key, array) in enumerate(zip(keys, arrays, strict=True)):
                backend.put(NAMESPACE, key, 0, array.data.cast("B"))
                if at % 32 == 31:  # within the put queue's bytes
                    assert backend.flush(timeout=600), "the file tier lost a put"
            assert backend.flush(timeout=600), "the file tier lost a put"
            paths = [root / "bench" / NAMESPACE.hex() / file_name(key, 0) for key in keys]
            direct = backend.read_mode == "O_DIRECT"

            def restore() -> None:
                assert backend.lookup(NAMESPACE, keys, [0]) == count
                found = backend.promote(NAMESPACE, keys, [0])
                assert len(found) == count, f"{count - len(found)} blocks missing"
                found.clear()

            memcpy_src = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
            memcpy_dst = memcpy_src.copy()
            figures = interleaved_gbps(
                total,
                args.rounds,
                {
                    "memcpy": lambda: np.copyto(memcpy_dst, memcpy_src),
                    "bare read, 1 thread": bare_read(paths, direct, 1),
                    f"bare read, {READ_THREADS} threads": bare_read(paths, direct, READ_THREADS),
                    "restore (Lookup + Promote)": restore,
                },
            )
        finally:
            backend.close()
        key_path = root / "data.keys"
        key_path.write_text(new_data_key_line(1))
        key_path.chmod(0o600)
        sealer = Sealer(*read_data_keys(key_path))
        sealed_root = root / "sealed"
        sealed_root.mkdir(mode=0o700)
        tier = ColdTier(
            get_codec("none", group_size=128), {"kv": FileTier(sealed_root, "bench")}, sealer=sealer
        )
        try:
            for at, (key, array) in enumerate(zip(keys, arrays, strict=True)):
                tier.store(NAMESPACE, key, 0, array.copy())
                if at % 32 == 31:  # within the tier's pending-encode budget
                    assert tier.flush(timeout=600), "the sealed tier lost a put"
            assert tier.flush(timeout=600), "the sealed tier lost a put"
            outs = [np.empty_like(array) for array in arrays]

            def sealed_load() -> None:
                failed = tier.load(NAMESPACE, keys, {"kv": [0]}, lambda index, part: outs[index])
                assert not failed, f"{len(failed)} blocks failed"

            figures |= interleaved_gbps(
                total, args.rounds, {"sealed load (open + decode)": sealed_load}
            )
            assert all(np.array_equal(a, b) for a, b in zip(arrays, outs, strict=True))
        finally:
            tier.close()
    bare = max(figures["bare read, 1 thread"], figures[f"bare read, {READ_THREADS} threads"])
    table = Table(
        title=f"file tier, {format_size(total)} in {count} blocks of {format_size(block)}, "
        f"reads {'O_DIRECT' if direct else 'buffered (O_DIRECT refused)'}, {args.rounds} rounds"
    )
    table.add_column("what")
    table.add_column("GB/s", justify="right")
    table.add_column("÷ bare read", justify="right")
    for name, gbps in figures.items():
        table.add_row(name, f"{gbps:.2f}", f"{gbps / bare:.2f}x")
    Console().print(table)
    ratio = figures["restore (Lookup + Promote)"] / bare
    print(f"restore ÷ bare read: {ratio:.2f}x (target ≥ 0.8x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
