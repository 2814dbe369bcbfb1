"""A new engine's first restore against its next one: receive pool filled at start or not.

    python benchmarks/bench_first_restore.py       # 256 MiB of 1 MiB blocks, 3 engines each
    python benchmarks/bench_first_restore.py --bytes 128MiB --engines 2

A `tierkv vault` process on 127.0.0.1 holds --bytes of lossless fp16 blocks of --block bytes.
Each "engine" is a fresh interpreter that starts a ColdTier from a config naming that vault,
makes one call (a restore of one small block: the connection and the tier's threads), then
restores every block twice with `ColdTier.load` into destination arrays it touched before (as an
engine's KV cache is), timing each restore and counting its minor page faults (getrusage). It
runs with `[client] receive_pool_bytes` at 0 (buffers mapped during the first restore: the
old behaviour) and at the default (mapped and touched at start: the start-up line's figures).
memcpy of the same bytes into touched ("warm") and fresh ("cold") memory is measured in the
same run. Target: first restore >= 0.8x the next one.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
from bench_vault import memcpy_gbps, running_vault
from rich.console import Console
from rich.table import Table

from tierkv.config import ClientConfig, TierKVConfig, config_from_mapping
from tierkv.sizes import format_size, parse_size
from tierkv.tier import ColdTier

NAMESPACE = b"bench-first-rest"
DTYPE = "fp16"


def block_key(i: int) -> bytes:
    return b"first-restore-%08d" % i


def config(address: str, pool_bytes: int) -> TierKVConfig:
    """A config naming the vault at `address`, with benchmark deadlines (a loaded machine)."""
    return config_from_mapping(
        {
            "cluster.kv_cold": address,
            "client.receive_pool_bytes": pool_bytes,
            "client.deadline_ms": 30_000,
            "client.promote_deadline_ms": 300_000,
        },
        "bench",
    )


def store(address: str, blocks: int, block_bytes: int) -> None:
    """Store `blocks` lossless fp16 blocks (the last one of 64 bytes: the first call's)."""
    tier = ColdTier.from_config(config(address, 0), warm_dtypes=())
    rng = np.random.default_rng(0)
    for i in range(blocks + 1):
        size = block_bytes if i < blocks else 64
        tier.store(NAMESPACE, block_key(i), 0, rng.standard_normal(size // 2).astype(np.float16))
    assert tier.flush(timeout=300), "the vault did not store every block"
    tier.close()


def engine(address: str, pool_bytes: int, blocks: int, block_bytes: int) -> dict[str, float]:
    """One fresh engine (this process): start-up, the first call, then two timed restores."""
    started = time.perf_counter()
    tier = ColdTier.from_config(config(address, pool_bytes), warm_dtypes=(DTYPE,))
    startup_s = time.perf_counter() - started
    keys = [block_key(i) for i in range(blocks + 1)]
    outs = [np.ones(block_bytes // 2, np.float16) for _ in range(blocks)]  # touched, as a cache
    small = np.ones(32, np.float16)
    assert not tier.load(NAMESPACE, keys[-1:], {"kv": [0]}, lambda i, part: small)
    found: dict[str, float] = {"startup_s": startup_s, "pool_s": tier.pool_s}
    for name in ("first", "next"):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        began = time.perf_counter()
        failed = tier.load(NAMESPACE, keys[:-1], {"kv": [0]}, lambda i, part: outs[i])
        found[f"{name}_s"] = time.perf_counter() - began
        found[f"{name}_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        assert not failed, f"{len(failed)} blocks did not restore"
    tier.close()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bytes", default="256MiB", help="bytes restored (default 256MiB)")
    parser.add_argument("--block", default="1MiB", help="block size (default 1MiB)")
    parser.add_argument("--engines", type=int, default=3, help="fresh engines per pool setting")
    parser.add_argument("--engine", nargs=4, help=argparse.SUPPRESS)  # the child's arguments
    args = parser.parse_args()
    if args.engine:
        address, pool, blocks, block = args.engine
        print(json.dumps(engine(address, int(pool), int(blocks), int(block))))
        return 0
    block_bytes = parse_size(args.block)
    blocks = max(1, parse_size(args.bytes) // block_bytes)
    total = blocks * block_bytes
    default_pool = ClientConfig().receive_pool_bytes
    rows: list[tuple[int, list[dict[str, float]]]] = []
    with running_vault(False, False) as (address, _):
        store(address, blocks, block_bytes)
        for pool in (0, default_pool):
            runs = []
            for _ in range(args.engines):
                child = [sys.executable, __file__, "--engine", address, str(pool)]
                done = subprocess.run(
                    [*child, str(blocks), str(block_bytes)],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=600,
                )
                runs.append(json.loads(done.stdout.splitlines()[-1]))
            rows.append((pool, runs))
    warm, cold = memcpy_gbps(total, 5)
    memcpy = statistics.median(warm)
    table = Table(
        title=f"First restore of a new engine: {format_size(total)} in blocks of "
        f"{format_size(block_bytes)}, {args.engines} engines each (median); memcpy of the same "
        f"bytes in this run: {memcpy:.2f} GB/s warm, {cold:.2f} GB/s cold"
    )
    for column in (
        "receive pool",
        "start-up s",
        "pool s",
        "first GB/s",
        "next GB/s",
        "first ÷ next",
        "first ÷ memcpy",
        "faults first / next",
    ):
        table.add_column(column, justify="right")
    for pool, runs in rows:

        def median(name: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(run[name] for run in runs)

        first = statistics.median(total / run["first_s"] / 1e9 for run in runs)
        after = statistics.median(total / run["next_s"] / 1e9 for run in runs)
        ratio = statistics.median(run["next_s"] / run["first_s"] for run in runs)
        table.add_row(
            format_size(pool) if pool else "0 (at first use)",
            f"{median('startup_s'):.2f}",
            f"{median('pool_s'):.3f}",
            f"{first:.2f}",
            f"{after:.2f}",
            f"{ratio:.2f}x",
            f"{first / memcpy:.2f}x",
            f"{median('first_faults'):.0f} / {median('next_faults'):.0f}",
        )
    Console(width=140).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
