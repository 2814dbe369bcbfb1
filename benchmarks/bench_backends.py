"""Promote throughput of every kind of cold store, from 1 and 8 concurrent restore workers.

    python benchmarks/bench_backends.py                     # 256 MiB in 1 MiB blocks, 3 rounds
    python benchmarks/bench_backends.py --total 1GiB --workers 1 --workers 4

Stores, all on 127.0.0.1: one `tierkv vault` process, two of them (blocks spread 1:1 by weighted
rendezvous hashing), one redis-server (or valkey-server), and a 3-node Redis Cluster. For each,
`--total` bytes of random payloads are Put through the tierkv backend, then every block is promoted
by N worker processes at once (tierkv.bench.pipeline.concurrent_promote: each worker its own
connections, checksums verified; "each" = one worker's GB/s, "all" = every worker's bytes ÷ first
start to last finish). References measured in the same run: numpy memcpy of the same bytes, and
redis-py pipelined GETs (hiredis, batches as the backend's) of the same payloads straight from the
same redis-server, without tierkv; the headline ratio is the vault's 1-worker Promote ÷ that GET.
Figures are medians of the rounds; on a shared machine they are noisy, the ratios less so."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import redis
from bench_vault import memcpy_gbps, running_vault
from rich.console import Console
from rich.table import Table

from tests.redis_servers import start_cluster, start_redis
from tierkv.backends import open_backend
from tierkv.backends.redis import PROMOTE_BATCH
from tierkv.bench.pipeline import bench_client_config, concurrent_promote
from tierkv.config import Endpoint
from tierkv.sizes import format_size, parse_size

NAMESPACE = b"bench-backends-0"


def redis_get_gbps(host: str, port: int, payloads: list[bytes], rounds: int) -> float:
    """Median GB/s of pipelined GETs of `payloads` from a redis server (no tierkv involved)."""
    client = redis.Redis(host=host, port=port, socket_timeout=300)
    names = [b"bench-raw:%d" % i for i in range(len(payloads))]
    for start in range(0, len(names), PROMOTE_BATCH):
        pipe = client.pipeline(transaction=False)
        for name, payload in zip(
            names[start : start + PROMOTE_BATCH], payloads[start:], strict=False
        ):
            pipe.set(name, payload)
        pipe.execute()
    total = sum(map(len, payloads))
    figures = []
    for _ in range(rounds):
        started = time.perf_counter()
        got = []
        for start in range(0, len(names), PROMOTE_BATCH):
            pipe = client.pipeline(transaction=False)
            for name in names[start : start + PROMOTE_BATCH]:
                pipe.get(name)
            got.extend(pipe.execute())
        figures.append(total / (time.perf_counter() - started) / 1e9)
        assert sum(map(len, got)) == total
        del got
    client.delete(*names)
    client.close()
    return statistics.median(figures)


def bench_store(
    addresses: list[str], payloads: list[bytes], workers: list[int], rounds: int
) -> tuple[float, dict[int, tuple[float, float]]]:
    """(median GB/s of promoting every block in this process, as the bare GET reference is,
    {workers: (median GB/s of one worker, median aggregate GB/s)})."""
    total = sum(map(len, payloads))
    client_cfg = bench_client_config(2 * total)
    backend = open_backend([Endpoint(a) for a in addresses], client_cfg)
    keys = [i.to_bytes(16, "little") for i in range(len(payloads))]
    try:
        for key, payload in zip(keys, payloads, strict=True):
            backend.put(NAMESPACE, key, 0, payload)
        if not backend.flush(timeout=600):
            raise RuntimeError(f"puts to {addresses} were lost: {backend.counters()}")
        backend.promote(NAMESPACE, keys[:1], [0])  # connect, as the GET reference already is
        here = []
        for _ in range(rounds):
            started = time.perf_counter()
            found = backend.promote(NAMESPACE, keys, [0])
            here.append(total / (time.perf_counter() - started) / 1e9)
            if len(found) != len(keys):
                raise RuntimeError(f"{addresses} returned {len(found)} of {len(keys)} blocks")
            del found
        figures = {}
        for count in workers:
            runs = [
                concurrent_promote(addresses, client_cfg, NAMESPACE, keys, [0], count)
                for _ in range(rounds)
            ]
            each = statistics.median(statistics.mean(per) for per, _ in runs)
            figures[count] = (each, statistics.median(aggregate for _, aggregate in runs))
        backend.clear(NAMESPACE)
        return statistics.median(here), figures
    finally:
        backend.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", default="256MiB", help="bytes per promote (default 256MiB)")
    parser.add_argument("--block", default="1MiB", help="payload size (default 1MiB)")
    parser.add_argument("--workers", type=int, action="append", help="repeatable (default 1, 8)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    total, block = parse_size(args.total), parse_size(args.block)
    workers = args.workers or [1, 8]
    data = np.random.default_rng(7).integers(0, 256, total, dtype=np.uint8)
    payloads = [data[i : i + block].tobytes() for i in range(0, total - block + 1, block)]
    total = sum(map(len, payloads))
    del data
    warm, _ = memcpy_gbps(total, args.rounds)
    memcpy = statistics.median(warm)
    results: dict[str, tuple[float, dict[int, tuple[float, float]]]] = {}
    with ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        vaults = [stack.enter_context(running_vault(False, False))[0] for _ in range(2)]
        single = start_redis(work_dir / "single")
        stack.callback(single.stop)
        cluster = start_cluster(work_dir / "cluster")
        for node in cluster:
            stack.callback(node.stop)
        stores = {
            "1 vault": [vaults[0]],
            "2 vaults": vaults,
            "redis": [f"redis://{single.address}"],
            "redis cluster": [f"redis+cluster://{cluster[0].address}"],
        }
        for name, addresses in stores.items():
            print(f"{name} ...", file=sys.stderr, flush=True)
            results[name] = bench_store(addresses, payloads, workers, args.rounds)
        get_gbps = redis_get_gbps("127.0.0.1", single.port, payloads, args.rounds)

    table = Table(
        title=f"Promote of {format_size(total)} in {format_size(block)} blocks, GB/s "
        f"(memcpy {memcpy:.2f} GB/s, bare redis-py GET {get_gbps:.2f} GB/s, same run)",
        caption="here = promoted in this process (like the GET reference); Nw = N worker "
        "processes at once: each = one worker's GB/s (mean), all = aggregate; ×memcpy of all",
    )
    table.add_column("store")
    table.add_column("here", justify="right")
    for count in workers:
        for label in ("each", "all", "×memcpy"):
            table.add_column(f"{count}w {label}", justify="right")
    for name, (here, figures) in results.items():
        cells = [f"{here:.2f}"]
        for count in workers:
            each, aggregate = figures[count]
            cells += [f"{each:.2f}", f"{aggregate:.2f}", f"{aggregate / memcpy:.2f}"]
        table.add_row(name, *cells)
    Console(width=160).print(table)
    vault_here = results["1 vault"][0]
    ratio = vault_here / get_gbps
    verdict = "meets" if ratio >= 1.3 else "BELOW"
    print(
        f"vault Promote ÷ bare redis GET of the same bytes, both in this process: "
        f"{vault_here:.2f} / {get_gbps:.2f} = {ratio:.2f}× ({verdict} the 1.3× floor); "
        f"memcpy {memcpy:.2f} GB/s in this run"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
