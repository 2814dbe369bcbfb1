"""N engine processes restoring at once from one tier (vault, file, Redis), beside references.

    python benchmarks/bench_engines.py                      # 8 engines × 64 MiB in 1 MiB blocks
    python benchmarks/bench_engines.py --engines 4 --per-engine 128MiB --codec int8 --json

Each "engine" is a client process (not a vLLM engine) that restores through the client path a
vLLM worker uses: its data mover (tierkv.movers.BlockMover) over a float16 KV buffer on the CPU,
fetching through a ColdTier (its receive pool filled, its codec's Numba kernels warmed) over the
backend `open_backend` makes of the tier's address: lossless payloads received straight into
their blocks, others decoded through the staging.
The tiers, all on this machine: one `tierkv vault` process on 127.0.0.1, a file tier in a
directory under a temporary directory, one redis-server on 127.0.0.1. Every block is stored
once through each tier, then two scenarios run:

- distinct: each engine restores its own `--per-engine` bytes (its own prompts);
- shared: every engine restores the same `--per-engine` bytes (one popular prompt).

References, by the same processes in the same run: Redis MGET of the very values the Redis tier
holds (redis-py, no tierkv: the bare Redis read), a bare read of the file tier's files (read the
way the tier reads, O_DIRECT or buffered, no checksum, no decode), a bare TCP stream of as many
bytes from one server process over a connection per engine (no tierkv code, no checksum: what
loopback TCP itself moves on this machine, the ceiling of any vault), and numpy memcpy of as
many bytes in each process. Each engine runs a job once untimed (connections, page faults), then all
start together at a barrier. Reported per row: aggregate GB/s of stored payload bytes (every
engine's bytes ÷ first start to last finish), its ratio to the memcpy row and to the MGET row,
the slowest engine's time over the fastest's, and CPU seconds per GB on the client side (all
engine processes, getrusage) and on the server side (the vault or redis-server process,
/proc/PID/stat; the file tier has no server, its kernel time is in the client's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import resource
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import redis  # noqa: E402
import torch  # noqa: E402
from bench_file_tier import bare_read  # noqa: E402
from bench_vault import STREAM_BYTES, running_vault  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.redis_servers import start_redis  # noqa: E402
from tierkv.backends import open_backend  # noqa: E402
from tierkv.backends.file import READ_THREADS, file_name  # noqa: E402
from tierkv.backends.redis import redis_key  # noqa: E402
from tierkv.bench.pipeline import bench_client_config  # noqa: E402
from tierkv.config import ConnectorConfig, Endpoint  # noqa: E402
from tierkv.heap import keep_freed_memory  # noqa: E402
from tierkv.keys import chain_block_keys, namespace_fingerprint  # noqa: E402
from tierkv.load import Consume  # noqa: E402
from tierkv.movers import BlockMover, StagingRing  # noqa: E402
from tierkv.quant import CODEC_NAMES, get_codec  # noqa: E402
from tierkv.reliability import payload_bytes  # noqa: E402
from tierkv.sizes import format_size, parse_size  # noqa: E402
from tierkv.tier import ColdTier  # noqa: E402
from tierkv.transfer import Into  # noqa: E402

NAMESPACE = namespace_fingerprint({"bench": "engines"})
TENANT = "bench"
MGET_BATCH_BYTES = 32 << 20
"""Bytes of values one MGET asks for (the reference's batches)."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat), every thread's."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def child_pid(marker: str) -> int:
    """The pid of this process's child whose command line holds `marker`."""
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                return int(pid)
    raise RuntimeError(f"no child process runs {marker!r}")


_WANTED = struct.Struct("<Q")


class _Streamer(socketserver.BaseRequestHandler):
    """Answers each request of an 8-byte length with that many bytes, until the client leaves."""

    def handle(self) -> None:
        chunk = memoryview(os.urandom(STREAM_BYTES))
        while request := self.request.recv(_WANTED.size, socket.MSG_WAITALL):
            (left,) = _WANTED.unpack(request)
            while left:
                self.request.sendall(chunk[: min(left, STREAM_BYTES)])
                left -= min(left, STREAM_BYTES)


def serve_tcp_streams() -> None:
    """The bare TCP stream's server: prints its port, then serves each connection on a thread."""
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Streamer) as server:
        print(server.server_address[1], flush=True)
        server.serve_forever()


@contextmanager
def tcp_streamer() -> Iterator[tuple[int, int]]:
    """A bare TCP stream server process on 127.0.0.1: (port, pid)."""
    process = subprocess.Popen([sys.executable, __file__, "--serve-tcp"], stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline()), process.pid
    finally:
        process.kill()
        process.wait(timeout=60)


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def job_runner(
    job: dict[str, Any], block_elems: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(run once, close) of one engine's `job`: a restore through a tier, or a reference."""
    keys: list[bytes] = job["keys"]
    kind = job["kind"]
    if kind == "restore":
        client_cfg = bench_client_config(1 << 30)
        backend = open_backend([Endpoint(job["address"])], client_cfg)
        tier = ColdTier(get_codec(job["codec"], group_size=128), {"kv": backend})
        tier.fill_receive_pool(client_cfg.receive_pool_bytes)
        keep_freed_memory(client_cfg.kept_freed_bytes)
        tier.warm_up(["fp16"], block_elems * 2, state=False)
        staging = ConnectorConfig().staging_bytes
        mover = engine_mover(len(keys), block_elems, staging)
        batch = max(1, staging // 2 // mover.block_bytes)  # as the vLLM worker batches its loads

        def fetch(start: int, stop: int, consume: Consume, into: Into | None) -> set[int]:
            return tier.load_blocks(NAMESPACE, keys[start:stop], {"kv": [0]}, consume, into)

        def restore() -> None:
            failed = mover.load(list(range(len(keys))), fetch, batch_blocks=batch)
            assert not failed, f"{len(failed)} of {len(keys)} blocks not restored"

        return restore, tier.close
    if kind == "mget":
        client = redis.Redis(host="127.0.0.1", port=job["port"], socket_timeout=300)
        names = [redis_key(NAMESPACE, key, 0) for key in keys]
        step = max(1, MGET_BATCH_BYTES // job["payload_bytes"])

        def mget() -> None:
            for start in range(0, len(names), step):
                got = client.mget(names[start : start + step])
                assert all(value is not None for value in got), "a value is missing"

        return mget, client.close
    if kind == "file read":
        directory = Path(job["directory"])
        paths = [directory / file_name(key, 0) for key in keys]
        return bare_read(paths, job["direct"], READ_THREADS), lambda: None
    if kind == "tcp stream":
        sock = socket.create_connection(("127.0.0.1", job["port"]), timeout=300)
        into = np.zeros(STREAM_BYTES, dtype=np.uint8).data  # touched, reused

        def stream() -> None:
            sock.sendall(_WANTED.pack(job["bytes"]))
            left = job["bytes"]
            while left:
                left -= sock.recv_into(into[: min(left, STREAM_BYTES)], 0, socket.MSG_WAITALL)

        return stream, sock.close
    src = np.random.default_rng(1).integers(0, 256, job["bytes"], dtype=np.uint8)
    dst = src.copy()
    return lambda: np.copyto(dst, src), lambda: None


def engine_mover(blocks: int, block_elems: int, staging: int) -> BlockMover:
    """The data mover a vLLM worker restores through, over an engine KV buffer of `blocks`
    float16 blocks on the CPU (blocks first: a lossless payload is received straight into its
    block, as into vLLM's), with staging rings of `staging` bytes."""
    layer = torch.zeros((blocks, block_elems), dtype=torch.float16)  # touched, as a KV cache is
    return BlockMover([[(layer, 0)]], StagingRing(staging), StagingRing(staging))


def engine(index: int, block_elems: int, pipe: Connection, barrier: Barrier) -> None:
    """One engine process: for each job it is sent, run it once untimed, wait for every engine
    at the barrier, run it timed and send back (start, end, CPU seconds). A job that fails
    breaks the barrier (no one waits out its timeout) and sends its error instead."""
    while (job := pipe.recv()) is not None:
        try:
            run, close = job_runner(job, block_elems)
            try:
                run()
                barrier.wait()
                cpu = own_cpu_s()
                started = time.monotonic()
                run()
                ended = time.monotonic()
                pipe.send((started, ended, own_cpu_s() - cpu))
            finally:
                close()
        except Exception as exc:
            barrier.abort()
            pipe.send(f"engine {index}: {type(exc).__name__}: {exc}")
            return


class Engines:
    """N engine processes (spawned, as engines are separate programs) taking jobs."""

    def __init__(self, count: int, block_elems: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.barrier = context.Barrier(count + 1, timeout=300)
        self.pipes: list[Connection] = []
        self.processes = []
        for index in range(count):
            here, there = context.Pipe()
            process = context.Process(
                target=engine, args=(index, block_elems, there, self.barrier), daemon=True
            )
            process.start()
            self.pipes.append(here)
            self.processes.append(process)

    def run(self, jobs: list[dict[str, Any]], server_pid: int | None) -> dict[str, float]:
        """Send each engine its job; the aggregate, its spread and the CPU each side spent."""
        for pipe, job in zip(self.pipes, jobs, strict=True):
            pipe.send(job)
        with contextlib.suppress(threading.BrokenBarrierError):
            self.barrier.wait()
        server_cpu = process_cpu_s(server_pid) if server_pid else 0.0
        results = [pipe.recv() for pipe in self.pipes]
        failed = [result for result in results if isinstance(result, str)]
        if failed:  # the first engine's own error, not the others' broken barrier
            raise SystemExit(next((e for e in failed if "BrokenBarrier" not in e), failed[0]))
        server_cpu = (process_cpu_s(server_pid) - server_cpu) if server_pid else float("nan")
        total = sum(job["bytes"] for job in jobs)
        times = [end - start for start, end, _ in results]
        window = max(end for _, end, _ in results) - min(start for start, _, _ in results)
        return {
            "gbps": total / window / 1e9,
            "slowest_over_fastest": max(times) / min(times),
            "slowest_s": max(times),
            "fastest_s": min(times),
            "client_cpu_s_per_gb": sum(cpu for _, _, cpu in results) / (total / 1e9),
            "server_cpu_s_per_gb": server_cpu / (total / 1e9),
        }

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(BrokenPipeError):  # an engine that failed has gone
                pipe.send(None)
        for process in self.processes:
            process.join(timeout=60)


@contextmanager
def stores(scratch: Path) -> Iterator[dict[str, Any]]:
    """The three tiers and the bare TCP streamer, running: {"vault": address, "vault_pid",
    "redis_port", "redis_pid", "file": file:// address, "file_dir": the tenant's directory,
    "tcp_port", "tcp_pid"}."""
    with ExitStack() as stack:
        vault, _ = stack.enter_context(running_vault(False, False))
        tcp_port, tcp_pid = stack.enter_context(tcp_streamer())
        server = start_redis(scratch / "redis")
        stack.callback(server.stop)
        file_root = scratch / "files"
        file_root.mkdir(mode=0o700)
        yield {
            "vault": vault,
            "vault_pid": child_pid(vault),
            "redis": f"redis://127.0.0.1:{server.port}",
            "redis_port": server.port,
            "redis_pid": server.process.pid,
            "file": f"file://{file_root}?tenant={TENANT}",
            "file_dir": file_root / TENANT / NAMESPACE.hex(),
            "tcp_port": tcp_port,
            "tcp_pid": tcp_pid,
        }


def store_everything(
    where: dict[str, Any], codec: str, keys: list[bytes], block_elems: int
) -> tuple[int, str]:
    """Store a random float16 block (one layer of `block_elems`) under each of `keys` through
    each tier; (stored payload bytes per block, the file tier's read mode)."""
    client_cfg = bench_client_config(1 << 30)
    tiers = {
        name: ColdTier(
            get_codec(codec, group_size=128),
            {"kv": open_backend([Endpoint(where[name])], client_cfg)},
        )
        for name in ("vault", "file", "redis")
    }
    rng = np.random.default_rng(0)
    stored = 0
    try:
        for at, key in enumerate(keys):
            shape = (1, block_elems)  # one layer of one block: the engines' mover's block
            block = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
            stored = stored or payload_bytes(tiers["vault"].stored_form(block))
            for tier in tiers.values():
                tier.store(NAMESPACE, key, 0, block)
            if at % 32 == 31:  # within each tier's pending-encode budget
                for name, tier in tiers.items():
                    assert tier.flush(timeout=600), f"the {name} tier lost a put: {tier.stats()}"
        for name, tier in tiers.items():
            assert tier.flush(timeout=600), (
                f"the {name} tier lost a put: {tier.vaults['kv'].counters()}"
            )
        read_mode = tiers["file"].vaults["kv"].read_mode  # type: ignore[attr-defined]
    finally:
        for tier in tiers.values():
            tier.close()
    return stored, read_mode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=8, help="engine processes (default 8)")
    parser.add_argument("--per-engine", default="64MiB", help="KV bytes each engine restores")
    parser.add_argument("--block", default="1MiB", help="KV bytes per block (default 1MiB)")
    parser.add_argument("--codec", default="none", help=f"one of {', '.join(CODEC_NAMES)}")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--json", action="store_true", help="one JSON object, no table")
    parser.add_argument("--serve-tcp", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_tcp:
        serve_tcp_streams()
        return 0
    try:
        get_codec(args.codec)
    except ValueError as error:
        parser.error(f"--codec: {error}")
    if args.engines < 1:
        parser.error(f"--engines {args.engines}: expected at least 1")
    block = parse_size(args.block)
    count = max(1, parse_size(args.per_engine) // block)
    block_elems = block // 2
    keys = chain_block_keys(list(range(count * args.engines)), block_tokens=1)
    own = [keys[i * count : (i + 1) * count] for i in range(args.engines)]
    scenarios = {"distinct": own, "shared": [keys[:count]] * args.engines}
    engines = Engines(args.engines, block_elems)
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="tierkv-bench-") as scratch:
            Path(scratch).chmod(0o700)
            with stores(Path(scratch)) as where:
                print("storing ...", file=sys.stderr, flush=True)
                stored, read_mode = store_everything(where, args.codec, keys, block_elems)
                each = stored * count
                for scenario, key_sets in scenarios.items():
                    runs: dict[str, tuple[dict[str, Any], int | None]] = {
                        "memcpy": ({"kind": "memcpy"}, None),
                        "redis MGET": (
                            {"kind": "mget", "port": where["redis_port"]}, where["redis_pid"]
                        ),
                        "file bare read": (
                            {"kind": "file read", "directory": str(where["file_dir"]),
                             "direct": read_mode == "O_DIRECT"},
                            None,
                        ),
                        "bare TCP stream": (
                            {"kind": "tcp stream", "port": where["tcp_port"]}, where["tcp_pid"]
                        ),
                    }  # fmt: skip
                    for tier in ("vault", "file", "redis"):
                        job = {"kind": "restore", "address": where[tier], "codec": args.codec}
                        runs[f"{tier} restore"] = (job, where.get(f"{tier}_pid"))
                    for what, (job, pid) in runs.items():
                        print(f"{scenario}: {what} ...", file=sys.stderr, flush=True)
                        jobs = [
                            job | {"keys": these, "bytes": each, "payload_bytes": stored}
                            for these in key_sets
                        ]
                        rows.append({"scenario": scenario, "what": what} | engines.run(jobs, pid))
    finally:
        engines.close()
    for row in rows:
        same = {r["what"]: r["gbps"] for r in rows if r["scenario"] == row["scenario"]}
        row["x_memcpy"] = row["gbps"] / same["memcpy"]
        row["x_redis_mget"] = row["gbps"] / same["redis MGET"]
        row["x_tcp"] = row["gbps"] / same["bare TCP stream"]
    setup = {
        "engines": args.engines,
        "per_engine_bytes": each,
        "block_bytes": block,
        "stored_block_bytes": stored,
        "codec": args.codec,
        "file_reads": read_mode,
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(setup | {"rows": rows}))
        return 0
    table = Table(
        title=f"{args.engines} engines at once, each {format_size(each)} of stored payloads in "
        f"{count} blocks of {format_size(block)} KV (codec {args.codec}), file tier reads "
        f"{read_mode}; same-run references: memcpy, redis MGET, file bare read, bare TCP stream",
        caption="GB/s = every engine's bytes ÷ first start to last finish; CPU s/GB: all "
        "engine processes (client) and the vault / redis-server process (server)",
    )
    columns = (
        "scenario",
        "what",
        "GB/s",
        "× memcpy",
        "× MGET",
        "× TCP",
        "slow ÷ fast",
        "slowest s",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("scenario", "what") else "right")
    table.add_column("client CPU s/GB", justify="right")
    table.add_column("server CPU s/GB", justify="right")
    for row in rows:
        server = row["server_cpu_s_per_gb"]
        table.add_row(
            row["scenario"],
            row["what"],
            f"{row['gbps']:.2f}",
            f"{row['x_memcpy']:.2f}",
            f"{row['x_redis_mget']:.2f}",
            f"{row['x_tcp']:.2f}",
            f"{row['slowest_over_fastest']:.2f}",
            f"{row['slowest_s']:.2f}",
            f"{row['client_cpu_s_per_gb']:.2f}",
            "-" if server != server else f"{server:.2f}",
        )
    Console(width=170).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
