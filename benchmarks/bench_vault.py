"""Vault throughput: Put then Promote N bytes in blocks, against numpy memcpy of the same bytes.

    python benchmarks/bench_vault.py                      # 1 GiB in 1 MiB blocks, vault process
    python benchmarks/bench_vault.py --block 512KiB --block 4MiB --rounds 7
    python benchmarks/bench_vault.py --in-process         # vault embedded in this process
    python benchmarks/bench_vault.py --reuse-memory       # engine side keeps freed memory too
    python benchmarks/bench_vault.py --no-tls             # skip the rows over TLS
    python benchmarks/bench_vault.py --disk               # + disk tier rows and restart times
    python benchmarks/bench_vault.py --disk --disk-dir /mnt/nvme/tmp --restart 1GiB --restart 10GiB

The vault runs as a real `tierkv vault` process on 127.0.0.1 (as on a LAN machine, but without
the network) unless --in-process. Put = queue every block with VaultClient.put and wait for
flush() (every block acknowledged by the vault); Promote = one VaultClient.promote of every block
(checksums verified); both travel over the vault's bulk data path (tierkv/vault/bulk.py).
memcpy = numpy copy of the same number of bytes into a buffer that was already touched ("warm",
median and best of the rounds; ratios use the median), and into fresh memory ("cold"). A plain
gRPC stream of raw chunks between two processes is measured in the same run, as the ceiling of
the gRPC path that the bulk path replaces. The vault process reuses freed memory and runs with
a huge-page malloc heap (tierkv.vault.memory); this client process gets the huge-page heap too,
as `tierkv serve` gives vLLM (--plain-malloc: not), and with --reuse-memory it reuses freed
memory as well. Each round re-stores the same keys, so round 1 shows a fresh vault (whose first
touch of memory can be slow in a VM) and later rounds the steady state of a full vault.
Every block size runs twice, plain and over TLS on both ports (a second vault with a
certificate made for the run, tests/tls_certs.py; the `cryptography` package of the dev extra),
so the cost of TLS shows beside the same memcpy.

Sealed blocks (tierkv/seal.py, AES-256-GCM under a data key made for the run; --no-seal: not)
run beside them on the plain vault: the "sealed" rows' Put seals every block on the calling
thread and then puts the sealed copies (as ColdTier does), their Promote promotes and opens every
block into pooled receive buffers (as ColdTier does). Then the cipher alone on the same blocks,
seal and open GB/s on one thread (one engine core) and on two threads (how far it parallelises:
`cryptography` 50 releases the GIL inside encrypt_into / decrypt_into). Last, the restore of
--restore-tokens tokens of a model's KV (default 30000 tokens of the default `tierkv bench`
shape, fp16, blocks of 256 tokens): promote unsealed against promote + open sealed, same vault,
rounds interleaved, the ratio unsealed ÷ sealed (1.0: sealing costs nothing).
With TLS rows, a bare socket stream between two processes (no tierkv code), plain and over
Python's ssl, with the receiver's CPU per GiB: the ceiling of one bulk connection over TLS.

--disk adds, in the same run, a vault with a disk tier (in a temporary directory under
--disk-dir) and a RAM tier of two blocks: each round Puts every block (a Put is acknowledged
once the disk tier has written it), so the blocks Promote returns come from disk: before
each Promote the segment files are synced and dropped from the page cache with
posix_fadvise(POSIX_FADV_DONTNEED) (the files of this benchmark only; /proc/sys/vm/drop_caches
would empty the cache of every process on the machine), and one more round reads them from a warm
page cache. Then the restart time: segments of 1 GiB and 10 GiB (--restart) of blocks are written
with DiskTier, dropped from the page cache, and a `tierkv vault` is started on them; the figures
are the vault's own recovery time (index rebuilt from record headers) and the time until it
answers. Last, buffered reads against O_DIRECT reads of the same segment file, cache dropped, as
the measurement behind reading without O_DIRECT. Everything written is deleted at the end.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
from rich.console import Console
from rich.table import Table

from tierkv.backends.vault import VaultClient
from tierkv.checksum import block_checksum
from tierkv.config import SecurityConfig
from tierkv.heap import reuse_freed_memory
from tierkv.model_shapes import DEFAULT_MODEL_SHAPE, MODEL_SHAPES
from tierkv.seal import KEY_BYTES, OVERHEAD_BYTES, Sealer, block_address
from tierkv.sizes import MIB, format_size, parse_size
from tierkv.transfer import RECEIVE_BUFFERS
from tierkv.vault.disk import DiskTier
from tierkv.vault.memory import restart_with_huge_pages
from tierkv.vault.server import CHUNK_BYTES, serve

NAMESPACE = b"bench-vault-0000"
SEALED_NAMESPACE = b"bench-vault-seal"
RESTORE_BLOCK_TOKENS = 256
"""Tokens per block of the restore figure (`tierkv bench`'s default)."""


def memcpy_gbps(total: int, rounds: int) -> tuple[list[float], float]:
    """(warm GB/s per round, cold GB/s) of numpy copies of `total` bytes."""
    src = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
    started = time.perf_counter()
    dst = src.copy()  # fresh pages: the cold figure
    cold = total / (time.perf_counter() - started) / 1e9
    warm = []
    for _ in range(rounds):
        started = time.perf_counter()
        np.copyto(dst, src)
        warm.append(total / (time.perf_counter() - started) / 1e9)
    return warm, cold


RAW_METHOD = "/bench.Raw/Stream"


def serve_raw_stream(port: int, total: int, chunk: int) -> None:
    """A plain gRPC server streaming `total` bytes in `chunk`-byte messages."""
    reuse_freed_memory()  # as the vault process does
    payload = os.urandom(chunk)

    def stream(request: bytes, context: object) -> Iterator[bytes]:
        for _ in range(total // chunk):
            yield payload

    handler = grpc.method_handlers_generic_handler(
        "bench.Raw",
        {"Stream": grpc.unary_stream_rpc_method_handler(stream, lambda b: b, lambda b: b)},
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.max_send_message_length", -1)]
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def raw_stream_gbps(total: int, chunk: int, rounds: int) -> list[float]:
    """GB/s of receiving (and keeping) `total` bytes from a plain gRPC stream in another process."""
    port = _free_port()
    command = [sys.executable, __file__, "--serve-raw", str(port), "--total", str(total)]
    process = subprocess.Popen(
        [*command, "--raw-chunk", str(chunk)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        options = [("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.unary_stream(RAW_METHOD, lambda b: b, lambda b: b)
            figures = []
            for _ in range(rounds):
                started = time.perf_counter()
                kept = list(call(b"", timeout=300))
                figures.append(sum(map(len, kept)) / (time.perf_counter() - started) / 1e9)
                del kept
            return figures
    finally:
        process.terminate()
        process.wait(timeout=30)


STREAM_BYTES = 8 * MIB
"""Bytes per send and per receive buffer of the bare socket stream."""


def serve_socket_stream(port: int, total: int, certs: str) -> None:
    """Send `total` bytes to the one client of 127.0.0.1:`port`, over TLS when `certs` names
    the directory of tests/tls_certs.py's files, in sendall calls of STREAM_BYTES."""
    listener = socket.create_server(("127.0.0.1", port))
    print("ready", flush=True)
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if certs:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(Path(certs) / "server.crt", Path(certs) / "server.key")
        sock = context.wrap_socket(sock, server_side=True)
    payload = memoryview(os.urandom(STREAM_BYTES))
    for _ in range(total // STREAM_BYTES):
        sock.sendall(payload)
    sock.recv(1)  # the client's goodbye: all of it arrived
    sock.close()


def socket_stream(total: int, certs: Path | None) -> tuple[float, float]:
    """(GB/s, receiving CPU s per GiB) of a bare socket stream of `total` bytes from another
    process, over TLS with `certs` (Python's ssl: one 16 KiB record per recv_into), else plain
    (MSG_WAITALL: one call per buffer): the ceiling of one bulk connection, without tierkv."""
    port = _free_port()
    command = [sys.executable, __file__, "--serve-socket", str(port), "--total", str(total)]
    command += ["--socket-certs", str(certs or "")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        if certs is not None:
            context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
            sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
        view = memoryview(bytearray(STREAM_BYTES))
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(total // STREAM_BYTES):
            filled = 0
            while filled < len(view):
                if certs is None:
                    filled += sock.recv_into(view[filled:], 0, socket.MSG_WAITALL)
                else:
                    filled += sock.recv_into(view[filled:])
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        sock.sendall(b"k")
        sock.close()
        return total / seconds / 1e9, cpu / (total / 2**30)
    finally:
        process.wait(timeout=60)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def running_vault(
    in_process: bool, tls: bool, *options: str, log: Path | None = None
) -> Iterator[tuple[str, SecurityConfig]]:
    """(address, a client's [security]) of an unlimited vault on 127.0.0.1 (with `tls`: over
    TLS, with certificates made for it; more `tierkv vault` options, its output to `log`),
    stopped on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        vault_side = client_side = SecurityConfig()
        if tls:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from tests.tls_certs import make_certs

            certs = make_certs(Path(tmp) / "certs")
            vault_side = SecurityConfig(
                tls_cert=str(certs.server_cert), tls_key=str(certs.server_key)
            )
            client_side = SecurityConfig(tls_ca=str(certs.ca))
        if in_process:
            server = serve("127.0.0.1:0", 0, security=vault_side)
            try:
                yield server.address, client_side
            finally:
                server.stop(grace=0)
            return
        address = f"127.0.0.1:{_free_port()}"
        config = Path(tmp) / "tierkv.toml"
        config.write_text(
            f'[security]\ntls_cert = "{vault_side.tls_cert}"\ntls_key = "{vault_side.tls_key}"\n'
            if tls
            else ""
        )
        command = [sys.executable, "-m", "tierkv", "vault", "--config", str(config)]
        command += ["--listen", address, "--max-bytes", "unlimited", *options]
        with open(log or os.devnull, "wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            with VaultClient(address, security=client_side) as probe:
                while not probe.wait_ready(1):
                    if process.poll() is not None:
                        raise RuntimeError(f"tierkv vault on {address} exited")
            yield address, client_side
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)


def drop_page_cache(directory: Path) -> None:
    """Sync the segment files under `directory` and drop them from the page cache."""
    for path in directory.glob("*.seg"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_disk(
    data: np.ndarray, block: int, rounds: int, parent: Path
) -> tuple[list[tuple[float, float]], float]:
    """((Put GB/s, cold-cache Promote GB/s) per round, warm-cache Promote GB/s) of a vault with a
    disk tier: each round re-stores every block (acknowledged once the disk tier wrote it), then
    promotes them from disk."""
    count = len(data) // block
    keys = [i.to_bytes(16, "little") for i in range(count)]
    payloads = [data[i * block : (i + 1) * block].tobytes() for i in range(count)]
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        disk_dir = Path(tmp) / "disk"
        options = ["--max-bytes", str(2 * block), "--disk-dir", str(disk_dir)]
        with (
            running_vault(False, False, *options) as (address, _),
            VaultClient(
                address, deadline_s=60, promote_deadline_s=600, max_pending_bytes=len(data)
            ) as client,
        ):

            def put_gbps() -> float:
                started = time.perf_counter()
                for key, payload in zip(keys, payloads, strict=True):
                    client.put(NAMESPACE, key, 0, payload)
                if not client.flush(timeout=600):
                    raise RuntimeError(f"puts were lost: {client.counters()}")
                seconds = time.perf_counter() - started
                while (disk := client.stats().disk) is not None and disk.queued_bytes:
                    time.sleep(0.1)
                return count * block / seconds / 1e9

            def promote_gbps() -> float:
                started = time.perf_counter()
                found = client.promote(NAMESPACE, keys, [0])
                seconds = time.perf_counter() - started
                if len(found) != count or client.checksum_failures:
                    raise RuntimeError(f"promote returned {len(found)} of {count} blocks")
                return count * block / seconds / 1e9

            figures = []
            for _ in range(rounds):
                put = put_gbps()
                drop_page_cache(disk_dir)
                figures.append((put, promote_gbps()))
            return figures, promote_gbps()


def restart_seconds(size: int, block: int, parent: Path) -> tuple[float, float, int]:
    """(recovery s reported by the vault, s until it answers, blocks) for `size` bytes on disk."""
    payload = os.urandom(block)
    count = size // block
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        disk_dir = Path(tmp) / "disk"
        disk = DiskTier(disk_dir, 2 * size, "never")
        for i in range(count):
            key = i.to_bytes(16, "little")
            disk.write(NAMESPACE, key, 0, payload, block_checksum(NAMESPACE, key, 0, payload))
            disk.wait_for_room()
        disk.close()
        drop_page_cache(disk_dir)
        log = Path(tmp) / "vault.log"
        options = ["--max-bytes", "1GiB", "--disk-dir", str(disk_dir)]
        started = time.perf_counter()
        with running_vault(False, False, *options, log=log):
            ready = time.perf_counter() - started
        recovery, recovered = recovery_of(log)
        return recovery, ready, recovered


def recovery_of(log: Path) -> tuple[float, int]:
    """(seconds, blocks) of the recovery a vault's start-up line reports in its `log`."""
    line = next(line for line in log.read_text().splitlines() if "recovered" in line)
    return float(line.split(" in ")[-1].split(" s;")[0]), int(
        line.split("recovered ")[1].split()[0]
    )


def direct_vs_buffered_gbps(parent: Path, size: int = 512 * MIB) -> tuple[float, float]:
    """(buffered, O_DIRECT) GB/s of reading one `size`-byte file in 8 MiB reads, cache dropped."""
    chunk = 8 * MIB
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        path = Path(tmp) / "0000000001.seg"
        path.write_bytes(os.urandom(chunk) * (size // chunk))
        figures = []
        for flags in (0, os.O_DIRECT):
            drop_page_cache(Path(tmp))
            buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
            fd = os.open(path, os.O_RDONLY | flags)
            try:
                started = time.perf_counter()
                for offset in range(0, size, chunk):
                    os.preadv(fd, [buffer], offset)
                figures.append(size / (time.perf_counter() - started) / 1e9)
            finally:
                os.close(fd)
                buffer.close()
        return figures[0], figures[1]


def bench_block_size(
    address: str,
    security: SecurityConfig,
    data: np.ndarray,
    block: int,
    rounds: int,
    sealer: Sealer | None = None,
) -> list[tuple[float, float]]:
    """(put GB/s, promote GB/s) per round, of payload bytes, for `data` cut into blocks of
    `block` bytes; with `sealer`, each put is seal + put and each promote is promote + open."""
    count = len(data) // block
    total = count * block
    payloads = [data[i * block : (i + 1) * block].tobytes() for i in range(count)]
    keys = [i.to_bytes(16, "little") for i in range(count)]
    namespace = NAMESPACE if sealer is None else SEALED_NAMESPACE
    figures = []
    with VaultClient(
        address,
        deadline_s=30,
        promote_deadline_s=300,
        max_pending_bytes=2 * total,
        security=security,
    ) as client:
        for _ in range(rounds):
            started = time.perf_counter()
            pieces = payloads if sealer is None else seal_all(sealer, keys, payloads)
            for key, piece in zip(keys, pieces, strict=True):
                client.put(namespace, key, 0, piece)
            if not client.flush(timeout=600):
                raise RuntimeError(f"puts were lost: {client.counters()}")
            put_s = time.perf_counter() - started
            started = time.perf_counter()
            found = client.promote(namespace, keys, [0])
            if len(found) != count or client.checksum_failures:
                raise RuntimeError(f"promote returned {len(found)} of {count} blocks")
            if sealer is not None:
                open_all(sealer, keys, found)
            promote_s = time.perf_counter() - started
            del found
            figures.append((total / put_s / 1e9, total / promote_s / 1e9))
        client.clear(namespace)
    return figures


def seal_all(
    sealer: Sealer, keys: list[bytes], payloads: list[bytes]
) -> list[tuple[bytes, memoryview]]:
    """Every payload sealed for its address (an empty clear part), as the pieces a put takes."""
    return [
        sealer.seal(block_address(SEALED_NAMESPACE, key, 0), b"", memoryview(payload))
        for key, payload in zip(keys, payloads, strict=True)
    ]


def open_all(sealer: Sealer, keys: list[bytes], found: dict[tuple[int, int], memoryview]) -> int:
    """Open every promoted block into pooled receive buffers back to back, as ColdTier does;
    the payload bytes opened. RuntimeError when one does not open."""
    room = RECEIVE_BUFFERS.buffer_bytes
    buffer, at, opened = RECEIVE_BUFFERS.take(), 0, 0
    for index in range(len(keys)):
        sealed = found[(index, 0)]
        size = sealer.opened_bytes(sealed)
        if at + size > room:
            buffer, at = RECEIVE_BUFFERS.take(), 0
        out = buffer.data[at : at + size] if size <= room else np.empty(size, np.uint8).data
        sealer.open_into(block_address(SEALED_NAMESPACE, keys[index], 0), sealed, out)
        at += size if size <= room else 0
        opened += size
    return opened


def cipher_gbps(
    sealer: Sealer, data: np.ndarray, block: int, threads: int, rounds: int
) -> tuple[float, float]:
    """(seal, open) GB/s of payload bytes, best of `rounds` after a warm-up, of `data` in blocks
    of `block` bytes on `threads` threads: seal as ColdTier does (each sealed copy in memory of
    its own), open into memory already touched (as the tier's pooled buffers are)."""
    count = len(data) // block
    views = [data.data[i * block : (i + 1) * block] for i in range(count)]
    addresses = [block_address(SEALED_NAMESPACE, i.to_bytes(16, "little"), 0) for i in range(count)]
    sealed = [
        b"".join(sealer.seal(address, b"", view))
        for address, view in zip(addresses, views, strict=True)
    ]
    opened = np.empty(count * block, np.uint8)
    opened.fill(0)

    def seal_range(first: int, end: int) -> None:
        for i in range(first, end):
            sealer.seal(addresses[i], b"", views[i])

    def open_range(first: int, end: int) -> None:
        for i in range(first, end):
            sealer.open_into(
                addresses[i], memoryview(sealed[i]), opened.data[i * block : (i + 1) * block]
            )

    def timed(work: Callable[[int, int], None]) -> float:
        bounds = [count * t // threads for t in range(threads + 1)]
        best = 0.0
        with futures.ThreadPoolExecutor(threads) as pool:
            for round_number in range(rounds + 1):
                started = time.perf_counter()
                list(pool.map(work, bounds[:-1], bounds[1:]))
                if round_number:  # the first is the warm-up
                    best = max(best, count * block / (time.perf_counter() - started) / 1e9)
        return best

    seal = timed(seal_range)
    return seal, timed(open_range)


def restore_seconds(
    address: str, tokens: int, model: str, rounds: int, sealer: Sealer
) -> tuple[list[float], list[float], int, int]:
    """(unsealed promote s, sealed promote + open s) per round, interleaved, of `tokens` tokens of
    `model`'s fp16 KV in blocks of RESTORE_BLOCK_TOKENS (+ its linear-attention state, one block
    per layer); and (bytes, blocks) restored."""
    shape = MODEL_SHAPES[model]
    block = RESTORE_BLOCK_TOKENS * shape.kv_bytes_per_token(2)
    sizes = [block] * (tokens // RESTORE_BLOCK_TOKENS)
    sizes += [shape.state_elements * 2] * shape.state_layers
    rng = np.random.default_rng(2)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]
    keys = [i.to_bytes(16, "little") for i in range(len(sizes))]
    total = sum(sizes)
    plain_s, sealed_s = [], []
    with VaultClient(
        address,
        deadline_s=30,
        promote_deadline_s=300,
        max_pending_bytes=2 * total + len(sizes) * OVERHEAD_BYTES,
    ) as client:
        for key, payload, sealed in zip(
            keys, payloads, seal_all(sealer, keys, payloads), strict=True
        ):
            client.put(NAMESPACE, key, 0, payload)
            client.put(SEALED_NAMESPACE, key, 0, sealed)
        if not client.flush(timeout=600):
            raise RuntimeError(f"restore blocks were lost: {client.counters()}")
        for _ in range(rounds):
            started = time.perf_counter()
            found = client.promote(NAMESPACE, keys, [0])
            plain_s.append(time.perf_counter() - started)
            if len(found) != len(keys):
                raise RuntimeError(f"promote returned {len(found)} of {len(keys)} blocks")
            del found
            started = time.perf_counter()
            found = client.promote(SEALED_NAMESPACE, keys, [0])
            if len(found) != len(keys):
                raise RuntimeError(f"promote returned {len(found)} of {len(keys)} sealed blocks")
            open_all(sealer, keys, found)
            sealed_s.append(time.perf_counter() - started)
            del found
        client.clear(NAMESPACE)
        client.clear(SEALED_NAMESPACE)
    return plain_s, sealed_s, total, len(sizes)


def add_rows(
    table: Table, path: str, block: str, figures: list[tuple[float, float]], warm: float
) -> None:
    """One row per round and a median row, each figure beside its ratio to warm memcpy."""
    rows = [(str(number), put, promote) for number, (put, promote) in enumerate(figures, 1)]
    rows.append(
        (
            "median",
            statistics.median(f[0] for f in figures),
            statistics.median(f[1] for f in figures),
        )
    )
    for label, put, promote in rows:
        table.add_row(
            path,
            block,
            label,
            f"{put:.2f}",
            f"{put / warm:.3f}x",
            f"{promote:.2f}",
            f"{promote / warm:.3f}x",
            style="bold" if label == "median" else None,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", default="1GiB", help="bytes moved per round (default 1GiB)")
    parser.add_argument("--block", action="append", help="block size, repeatable (default 1MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--in-process", action="store_true", help="embed the vault")
    parser.add_argument("--no-tls", action="store_true", help="skip the rows over TLS")
    parser.add_argument("--no-seal", action="store_true", help="skip the sealed figures")
    parser.add_argument(
        "--restore-tokens", type=int, default=30000, help="tokens of the sealed restore figure"
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL_SHAPE, choices=sorted(MODEL_SHAPES), help="its KV shape"
    )
    parser.add_argument(
        "--reuse-memory",
        action="store_true",
        help="apply tierkv.vault.memory.reuse_freed_memory() to this (the engine's) process too",
    )
    parser.add_argument(
        "--plain-malloc",
        action="store_true",
        help="keep glibc's default 4 KiB-page heap in this (the engine's) process",
    )
    parser.add_argument("--disk", action="store_true", help="add the disk tier's figures")
    parser.add_argument(
        "--disk-dir", type=Path, default=Path(tempfile.gettempdir()), help="--disk: where to write"
    )
    parser.add_argument(
        "--restart", action="append", help="--disk: restart sizes (default 1GiB and 10GiB)"
    )
    parser.add_argument("--serve-raw", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-socket", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--socket-certs", default="", help=argparse.SUPPRESS)
    parser.add_argument("--raw-chunk", type=int, default=CHUNK_BYTES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_raw:
        serve_raw_stream(args.serve_raw, parse_size(args.total), args.raw_chunk)
        return 0
    if args.serve_socket:
        serve_socket_stream(args.serve_socket, parse_size(args.total), args.socket_certs)
        return 0
    if not args.plain_malloc:
        restart_with_huge_pages()
    if args.reuse_memory and not reuse_freed_memory():
        raise SystemExit("--reuse-memory needs glibc")
    total = parse_size(args.total)
    blocks = [parse_size(b) for b in args.block or ["1MiB"]]
    console = Console()
    console.print(
        f"{format_size(total)} per round, {args.rounds} rounds, "
        f"vault {'in this process' if args.in_process else 'in its own process'}, "
        f"client process {'reuses' if args.reuse_memory else 'returns'} freed memory"
        f" ({'4 KiB pages' if args.plain_malloc else 'huge-page heap'}), "
        f"{os.cpu_count()} CPUs"
    )
    warm_rounds, cold = memcpy_gbps(total, args.rounds)
    warm = statistics.median(warm_rounds)
    data = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    table = Table(title="vault throughput (GB/s; ratio = / warm memcpy)")
    for column in ("path", "block", "round", "Put", "Put ratio", "Promote", "Promote ratio"):
        table.add_column(column, justify="right")
    sealer = Sealer({1: os.urandom(KEY_BYTES)}, 1)
    sealing: list[str] = []
    for tls in (False,) if args.no_tls else (False, True):
        with running_vault(args.in_process, tls) as (address, security):
            for block in blocks:
                figures = bench_block_size(address, security, data, block, args.rounds)
                add_rows(table, "TLS" if tls else "plain", format_size(block), figures, warm)
            if tls or args.no_seal:
                continue
            for block in blocks:
                figures = bench_block_size(address, security, data, block, args.rounds, sealer)
                add_rows(table, "sealed", format_size(block), figures, warm)
            sealing = sealing_lines(address, sealer, data, blocks, args, warm)
    for block in blocks if args.disk else []:
        disk_figures, disk_warm = bench_disk(data, block, args.rounds, args.disk_dir)
        add_rows(table, "disk", format_size(block), disk_figures, warm)
        table.add_row(
            "disk",
            format_size(block),
            "cache warm",
            "",
            "",
            f"{disk_warm:.2f}",
            f"{disk_warm / warm:.3f}x",
        )
    console.print(table)
    console.print(
        f"numpy memcpy: warm median {warm:.2f} GB/s (best {max(warm_rounds):.2f}), "
        f"cold (fresh pages) {cold:.2f} GB/s"
    )
    for line in sealing:
        console.print(line)
    if args.disk:
        console.print(
            f"disk rows: a vault with a disk tier under {args.disk_dir} and a RAM tier of two "
            "blocks; Put = every block re-stored and acknowledged; Promote of blocks only on disk, "
            "page cache of the segment files dropped with posix_fadvise(DONTNEED) before each "
            "round, except 'cache warm'"
        )
        for size in [parse_size(s) for s in args.restart or ["1GiB", "10GiB"]]:
            recovery, ready, recovered = restart_seconds(size, blocks[0], args.disk_dir)
            console.print(
                f"restart with {format_size(size)} on disk ({recovered} blocks of "
                f"{format_size(blocks[0])}, page cache dropped): index rebuilt in {recovery:.2f} s,"
                f" vault answering after {ready:.2f} s"
            )
        buffered, direct = direct_vs_buffered_gbps(args.disk_dir)
        console.print(
            f"one 512 MiB segment read in 8 MiB preadv calls, cache dropped: buffered "
            f"{buffered:.2f} GB/s, O_DIRECT {direct:.2f} GB/s"
        )
    if not args.no_tls:
        console.print(socket_streams_line(total, args.rounds))
    raw = raw_stream_gbps(total, CHUNK_BYTES, args.rounds)
    raw_median = statistics.median(raw)
    console.print(
        f"plain gRPC stream of {format_size(CHUNK_BYTES)} messages, kept (the gRPC path's ceiling):"
        f" median {raw_median:.2f} GB/s ({raw_median / warm:.3f}x), rounds "
        + ", ".join(f"{r:.2f}" for r in raw)
    )
    return 0


def socket_streams_line(total: int, rounds: int) -> str:
    """Bare socket streams between two processes, plain and TLS interleaved: the line to print."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.tls_certs import make_certs

    with tempfile.TemporaryDirectory() as tmp:
        certs = make_certs(Path(tmp) / "certs").ca.parent
        plain, tls = [], []
        for _ in range(rounds):
            plain.append(socket_stream(total, None))
            tls.append(socket_stream(total, certs))
    plain_gbps = statistics.median(p[0] for p in plain)
    tls_gbps = statistics.median(t[0] for t in tls)
    return (
        f"bare socket stream between two processes, no tierkv code, median of {rounds}: plain"
        f" {plain_gbps:.2f} GB/s (receiver CPU {statistics.median(p[1] for p in plain):.3f} s/GiB),"
        f" TLS {tls_gbps:.2f} GB/s ({statistics.median(t[1] for t in tls):.3f} s/GiB):"
        f" TLS / plain {tls_gbps / plain_gbps:.2f}x (the ceiling of one connection)"
    )


def sealing_lines(
    address: str,
    sealer: Sealer,
    data: np.ndarray,
    blocks: list[int],
    args: argparse.Namespace,
    warm: float,
) -> list[str]:
    """The cipher's GB/s per block size on one and two threads, and the sealed restore, as
    lines to print."""
    lines = []
    for block in blocks:
        one = cipher_gbps(sealer, data, block, 1, args.rounds)
        two = cipher_gbps(sealer, data, block, 2, args.rounds)
        lines.append(
            f"AES-256-GCM on {format_size(block)} blocks, best of {args.rounds}: seal {one[0]:.2f},"
            f" open {one[1]:.2f} GB/s on one thread; on two threads {two[0]:.2f} / {two[1]:.2f}"
            f" ({two[0] / one[0]:.2f}x / {two[1] / one[1]:.2f}x); memcpy {warm:.2f} GB/s"
        )
    plain_s, sealed_s, total, count = restore_seconds(
        address, args.restore_tokens, args.model, args.rounds, sealer
    )
    plain, sealed = statistics.median(plain_s), statistics.median(sealed_s)
    lines.append(
        f"restore of {args.restore_tokens} tokens ({args.model}, fp16, {total / 1e6:.0f} MB in"
        f" {count} blocks), median of {args.rounds}: unsealed promote {plain:.3f} s"
        f" ({total / plain / 1e9:.2f} GB/s), sealed promote + open {sealed:.3f} s"
        f" ({total / sealed / 1e9:.2f} GB/s): unsealed / sealed {plain / sealed:.2f}x"
    )
    return lines


if __name__ == "__main__":
    sys.exit(main())
