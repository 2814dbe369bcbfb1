"""Clear against a full disk tier: other clients' Promote latency and the restart time.

    python benchmarks/bench_vault_clear.py                     # 50k entries, 1,000 Clears
    python benchmarks/bench_vault_clear.py --entries 200000 --clears 5000 --json

A real `tierkv vault` process on 127.0.0.1 with a disk tier (in a temporary directory under
--disk-dir) and a --max-bytes that holds the disk index of every entry (which may take at most a
quarter of it; the RAM tier holds the rest) holds --entries blocks of --block bytes in one namespace
(another tenant's, as far as the Clears go). Then, in the same run:

- restart (reference): SIGTERM, start again on the same directory (three times, the fastest
  counts); the vault's own recovery time;
- Promote alone (reference): one client, in a process of its own, Promotes 4 of those blocks
  over and over (RAM hits after the first); latency p50 / p99 / max over --promotes calls;
- Promote during Deletes (reference): the same, while --clearers more clients each Put one
  block into a namespace of its own and Delete it, --clears times in all (the same calls as
  below, but a Delete of one key never cost more than that key);
- Promote during Clears: the same, but each client Clears its namespace instead of Deleting
  the key; the Delete and Clear calls' latency too;
- restart after the Clears: SIGTERM, start again (three times too); the recovery time, to set
  against the reference (the disk now holds every CLEAR record too).

With --json, one line of JSON with every figure (tests/test_vault_clear.py reads it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.queues import Queue as QueueType
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import TypeVar

from bench_vault import recovery_of, running_vault

from tierkv.backends.vault import VaultClient
from tierkv.cli.vault import INDEX_SHARE
from tierkv.sizes import MIB, parse_size
from tierkv.vault.disk import INDEX_BYTES_PER_BLOCK

HELD = b"bench-held-00000"
CLEARED = b"bench-clear-0000"
PROMOTED = 4
RESTARTS = 3
"""Restarts timed each time (the least counts: the machine's other load only adds)."""
RAM_TIER_BYTES = 4 * MIB
"""The RAM tier's own share of --max-bytes, besides what the disk tier's index takes."""
T = TypeVar("T")


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(address: str, entries: int, block: int) -> None:
    """Store `entries` blocks under HELD and wait until the disk tier wrote every one."""
    with VaultClient(address, deadline_s=60, max_pending_bytes=64 * MIB) as client:
        for i in range(entries):
            client.put(HELD, key(i), 0, i.to_bytes(8, "little") * (block // 8))
        if not client.flush(timeout=600) or client.stored_puts != entries:
            raise RuntimeError(f"the vault did not store every block: {client.counters()}")
        while (disk := client.stats().disk) is not None and disk.queued_bytes:
            time.sleep(0.05)


def promote_latencies(
    address: str, count: int, ready: EventType, stop: EventType, out: QueueType[list[float]]
) -> None:
    """Seconds of each Promote of PROMOTED held blocks, `count` of them or (once `stop` is set,
    e.g. at once) until `stop`, onto `out`; `ready` is set after the first (into RAM)."""
    keys = [key(i) for i in range(PROMOTED)]
    seconds: list[float] = []
    with VaultClient(address, deadline_s=60) as client:
        client.promote(HELD, keys, [0])
        ready.set()
        while len(seconds) < count or not stop.is_set():
            started = time.perf_counter()
            found = client.promote(HELD, keys, [0])
            seconds.append(time.perf_counter() - started)
            if len(found) != PROMOTED:
                raise RuntimeError(f"Promote returned {len(found)} of {PROMOTED} blocks")
    out.put(seconds)


def promotes_during(
    address: str, count: int, work: Callable[[], T] | None
) -> tuple[list[float], T | None]:
    """(Promote latencies, what `work` returned) of a client in a process of its own (this
    one's threads share a GIL), Promoting while `work` runs here; without `work`, `count`
    Promotes."""
    context = multiprocessing.get_context("spawn")
    ready, stop, out = context.Event(), context.Event(), context.Queue()
    if work is None:
        stop.set()
    promoter = context.Process(target=promote_latencies, args=(address, count, ready, stop, out))
    promoter.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the promoting client did not start")
        done = work() if work is not None else None
    finally:
        stop.set()
        seconds = out.get(timeout=600)
        promoter.join()
    return seconds, done


def remove_latencies(
    address: str, namespace: bytes, count: int, block: int, clear: bool
) -> list[float]:
    """Seconds of each of `count` Clears of `namespace` (not `clear`: Deletes of the one key),
    each after a Put of one block there."""
    seconds = []
    with VaultClient(address, deadline_s=60) as client:
        for i in range(count):
            client.put(namespace, key(i), 0, bytes(block))
            client.flush(timeout=60)
            started = time.perf_counter()
            if clear:
                client.clear(namespace)
            else:
                client.delete(namespace, [key(i)])
            seconds.append(time.perf_counter() - started)
    return seconds


def remove_in_parallel(
    address: str, count: int, clients: int, block: int, clear: bool
) -> list[float]:
    """Seconds of each Clear (or Delete), `count` of them made by `clients` clients at once
    (each in a namespace of its own)."""
    namespaces = [CLEARED[:-4] + b"%04d" % i for i in range(clients)]
    shares = [count // clients + (i < count % clients) for i in range(clients)]
    with ThreadPoolExecutor(clients) as pool:
        jobs = [
            pool.submit(remove_latencies, address, namespace, share, block, clear)
            for namespace, share in zip(namespaces, shares, strict=True)
        ]
        return [seconds for job in jobs for seconds in job.result()]


def restart_s(options: list[str], log: Path, times: int) -> tuple[float, int]:
    """(least recovery seconds, blocks recovered) of `times` restarts on the same directory."""
    found = []
    for _ in range(times):
        with running_vault(False, False, *options, log=log):
            pass
        found.append(recovery_of(log))
    return min(seconds for seconds, _ in found), found[-1][1]


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "max_ms": 1e3 * ordered[-1],
        "count": len(ordered),
    }


def run(
    entries: int, clears: int, clearers: int, promotes: int, block: int, parent: Path
) -> dict[str, object]:
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        disk_dir = Path(tmp) / "disk"
        log = Path(tmp) / "vault.log"
        # --max-bytes counts the disk index (at most INDEX_SHARE of it): room for every entry's
        ram_cap = RAM_TIER_BYTES + int(entries * INDEX_BYTES_PER_BLOCK / INDEX_SHARE)
        options = ["--max-bytes", str(ram_cap), "--disk-dir", str(disk_dir)]
        with running_vault(False, False, *options) as (address, _):
            fill(address, entries, block)
        reference, held = restart_s(options, log, RESTARTS)
        with running_vault(False, False, *options) as (address, _):
            alone, _ = promotes_during(address, promotes, None)
            deleting, deletes = promotes_during(
                address, 0, lambda: remove_in_parallel(address, clears, clearers, block, False)
            )
            during, clearing = promotes_during(
                address, 0, lambda: remove_in_parallel(address, clears, clearers, block, True)
            )
            assert deletes is not None and clearing is not None
        after, held_after = restart_s(options, log, RESTARTS)
    if held_after != held or held != entries:
        raise RuntimeError(f"restarts recovered {held} and {held_after} of {entries} blocks")
    return {
        "entries": entries,
        "clears": clears,
        "clearers": clearers,
        "promote_alone": summary_ms(alone),
        "promote_during_deletes": summary_ms(deleting),
        "promote_during_clears": summary_ms(during),
        "delete": summary_ms(deletes),
        "clear": summary_ms(clearing),
        "restart_reference_s": reference,
        "restart_after_clears_s": after,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=50_000, help="blocks held (default 50000)")
    parser.add_argument("--clears", type=int, default=1000, help="Clears made (default 1000)")
    parser.add_argument("--clearers", type=int, default=4, help="clients Clearing at once")
    parser.add_argument("--promotes", type=int, default=1000, help="reference Promotes")
    parser.add_argument("--block", default="1KiB", help="block size (default 1KiB)")
    parser.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    args = parser.parse_args()
    for name in ("entries", "clears", "clearers", "promotes"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    figures = run(
        args.entries,
        args.clears,
        args.clearers,
        args.promotes,
        parse_size(args.block),
        args.disk_dir,
    )
    if args.json:
        print(json.dumps(figures))
        return 0
    print(
        f"{args.entries} entries of {args.block} on disk, {args.clears} Clears by "
        f"{args.clearers} clients at once"
    )
    for name in (
        "promote_alone",
        "promote_during_deletes",
        "promote_during_clears",
        "delete",
        "clear",
    ):
        row = figures[name]
        assert isinstance(row, dict)
        print(
            f"{name:>22}: p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms, "
            f"max {row['max_ms']:.2f} ms ({row['count']} calls)"
        )
    print(
        f"restart: {figures['restart_reference_s']:.2f} s without the Clears (reference), "
        f"{figures['restart_after_clears_s']:.2f} s after them"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
