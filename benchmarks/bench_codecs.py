"""Codec throughput and fidelity on the K and V of 30,000 tokens x 8 KV heads x 128 dims.

For every codec and for fp16 and bf16 input it prints encode and decode GB/s (of uncompressed
bytes), the same figures as a fraction of numpy memcpy of the same bytes measured in the same
run, the compression ratio against the 16-bit input and the fidelity of the decoded K and V.
Two ways of calling the codecs are measured:

  whole   one call per K and per V tensor (the multi-threaded kernels),
  blocks  one call per block of --block-tokens tokens from --threads Python threads, as ColdTier
          encodes (the single-threaded kernels; they release the GIL, so the threads run in
          parallel; each payload is dropped once made, as ColdTier drops it once sent).
  runs    decode only, as ColdTier's load does: the block payloads lie back to back in one
          buffer, as a Promote receives them, and are decoded with decode_many in tasks of
          DECODE_TASK_BYTES on --threads threads (payloads it cannot take, the lossless ones,
          one by one with decode_into).

"payload GB/s" is decode speed counted in payload bytes consumed: what a link must deliver for the
decoder to keep up (10 GbE = 1.25 GB/s, 25 GbE = 3.1 GB/s). Targets on a 2-core machine (encode:
blocks, decode: runs): none encode >= 0.5x memcpy and decode >= 0.8x, int8 encode >= 0.35x,
TurboQuant encode >= 0.10x, every codec's decode >= 1.25 payload GB/s. Timings are the best of
--repeats runs.

Encodes write fresh payloads, which the C library maps afresh when they are large: in the whole
rows each encode writes two fresh 61 MB payloads. On this development VM a fresh mapping's first
touch is slow (a page fault per page, dearer in a VM), so the whole `none` encode ran at
0.04-0.05x memcpy while the same checked copy into memory already mapped ran at 1.2x. ColdTier
never encodes a lossless block: it sends the block's own memory behind a header.

The kernels are compiled for this CPU, or for the one --cpu (or NUMBA_CPU_NAME) names, e.g.
`--cpu haswell` for AVX2 + FMA + F16C on any x86 machine; the instruction set the compiler
emitted is printed beside memcpy. Give each CPU its own NUMBA_CACHE_DIR if you switch often
(Numba keys its cache by CPU, so mixing them is safe but keeps both sets of files).

    .venv/bin/python benchmarks/bench_codecs.py [--tokens 30000] [--codecs int8,tq3] [--cpu haswell]
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from rich.console import Console
from rich.table import Table


def _pick_cpu(argv: list[str]) -> None:
    """Apply --cpu NAME (as NUMBA_CPU_NAME) before tierkv's kernels, and so Numba, are loaded."""
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[1] if arg.startswith("--cpu=") else None
        if arg == "--cpu" and i + 1 < len(argv):
            name = argv[i + 1]
        if name:
            os.environ["NUMBA_CPU_NAME"] = name


_pick_cpu(sys.argv[1:])

from tierkv.load import DECODE_TASK_BYTES  # noqa: E402
from tierkv.quant import (  # noqa: E402 (after the CPU is chosen)
    CODEC_NAMES,
    decode_into,
    decode_many,
    fidelity,
    get_codec,
    warmup,
)
from tierkv.quant.target import instruction_set  # noqa: E402
from tierkv.transfer import batched_by_size  # noqa: E402

HEADS, HEAD_DIM = 8, 128


def synthetic_kv(tokens: int, seed: int = 0) -> np.ndarray:
    """K and V as one float32 array [2, tokens, heads, dim]; K has a few 10-20x outlier channels
    per head, as real keys do."""
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((2, tokens, HEADS, HEAD_DIM), dtype=np.float32)
    for head in range(HEADS):
        channels = rng.choice(HEAD_DIM, 4, replace=False)
        kv[0, :, head, channels] *= rng.uniform(10, 20, size=(4, 1)).astype(np.float32)
    return kv


def as_dtype(kv: np.ndarray, dtype: str) -> np.ndarray:
    """fp16 array, or bf16 words (uint16, rounded to nearest even)."""
    if dtype == "fp16":
        return kv.astype(np.float16)
    bits = kv.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def best_time(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def split_blocks(kv: np.ndarray, block_tokens: int) -> list[np.ndarray]:
    """Contiguous [block_tokens, heads, dim] blocks of K, then of V."""
    tokens = kv.shape[1]
    return [kv[p, t : t + block_tokens] for p in range(2) for t in range(0, tokens, block_tokens)]


def back_to_back(payloads: list[bytes]) -> list[memoryview]:
    """`payloads` copied back to back into one buffer, as views of it (a Promote's receive)."""
    buffer = memoryview(b"".join(payloads))
    offsets = np.cumsum([0] + [len(payload) for payload in payloads])
    return [buffer[start:stop] for start, stop in itertools.pairwise(offsets)]


def load_tasks(payloads: list[bytes], task_bytes: int) -> list[list[tuple[int, memoryview]]]:
    """The decode tasks of a load of `payloads` (block i into row i): received back to back, in
    tasks of about `task_bytes`."""
    received = list(enumerate(back_to_back(payloads)))
    return list(batched_by_size(received, lambda item: len(item[1]), task_bytes))


def decode_task(task: list[tuple[int, memoryview]], outs: np.ndarray) -> None:
    """One decode thread's task of a load: decode_many, then the payloads it did not take."""
    rows = [row for row, _ in task]
    done = decode_many([payload for _, payload in task], outs, rows)
    for (row, payload), ok in zip(task, done, strict=True):
        if not ok:
            decode_into(payload, outs[row])


def measure(
    name: str, kv: np.ndarray, dtype: str, args: argparse.Namespace, pool: ThreadPoolExecutor
) -> list[list[str]]:
    """Table rows (whole, blocks, runs) for one codec on one dtype."""
    codec = get_codec(name, HEAD_DIM)
    copy, out = np.empty_like(kv), np.empty_like(kv)
    payloads = [codec.encode(kv[p], dtype) for p in range(2)]
    for p in range(2):
        decode_into(payloads[p], out[p])
    quality = fidelity(kv, out, dtype)
    payload_bytes = sum(len(payload) for payload in payloads)
    ratio = kv.nbytes / payload_bytes
    blocks = split_blocks(kv, args.block_tokens)
    block_outs = [np.empty_like(block) for block in blocks]
    block_payloads = [codec.encode(block, dtype) for block in blocks]
    full = [index for index, block in enumerate(blocks) if len(block) == args.block_tokens]
    tails = [index for index, block in enumerate(blocks) if len(block) != args.block_tokens]
    run_outs = np.empty((len(full), args.block_tokens, HEADS, HEAD_DIM), kv.dtype)
    tasks = load_tasks([block_payloads[index] for index in full], DECODE_TASK_BYTES)

    def encode_whole() -> None:
        for p in range(2):
            codec.encode(kv[p], dtype)

    def decode_whole() -> None:
        for p in range(2):
            decode_into(payloads[p], out[p])

    def encode_blocks() -> None:
        deque(pool.map(lambda block: codec.encode(block, dtype), blocks), maxlen=0)

    def decode_blocks() -> None:
        list(pool.map(decode_into, block_payloads, block_outs))

    def decode_runs() -> None:
        list(pool.map(lambda task: decode_task(task, run_outs), tasks))
        for index in tails:  # the short last block of K and of V
            decode_into(block_payloads[index], block_outs[index])

    rows = []
    modes: list[tuple[str, Callable[[], None] | None, Callable[[], None]]] = [
        ("whole", encode_whole, decode_whole),
        ("blocks", encode_blocks, decode_blocks),
        ("runs", None, decode_runs),
    ]
    for mode, encode, decode in modes:
        memcpy_s = best_time(lambda: np.copyto(copy, kv), args.repeats)
        encode_s = best_time(encode, args.repeats) if encode is not None else None
        decode_s = best_time(decode, args.repeats)
        rows.append(
            [
                dtype,
                name,
                mode,
                f"{kv.nbytes / encode_s / 1e9:.2f}" if encode_s else "",
                f"{memcpy_s / encode_s:.2f}" if encode_s else "",
                f"{kv.nbytes / decode_s / 1e9:.2f}",
                f"{memcpy_s / decode_s:.2f}",
                f"{payload_bytes / decode_s / 1e9:.2f}",
                f"{ratio:.2f}",
                f"{quality.cosine:.5f}",
                f"{quality.snr_db:.1f}",
            ]
        )
    return rows


def check_cpu(name: str) -> None:
    """Exit with one line unless LLVM can compile for the CPU `name` (it aborts the process that
    tries, so a child process tries first)."""
    probe = "from tierkv.quant.target import instruction_set; instruction_set()"
    env = {**os.environ, "NUMBA_CPU_NAME": name}
    tried = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True)
    if tried.returncode:
        raise SystemExit(f"--cpu {name}: LLVM cannot compile for this CPU name on this machine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=30_000)
    parser.add_argument("--codecs", default=",".join(CODEC_NAMES))
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cpu",
        default=os.environ.get("NUMBA_CPU_NAME"),
        help="compile the kernels for this LLVM CPU name (e.g. haswell; default: this CPU)",
    )
    args = parser.parse_args()
    console = Console(width=132)
    start = time.perf_counter()
    if args.cpu:
        check_cpu(args.cpu)
    isa = instruction_set()
    warmup()
    console.print(f"warmup (compile or load cached kernels): {time.perf_counter() - start:.1f} s")
    kv32 = synthetic_kv(args.tokens)
    table = Table(
        title=f"codecs on K+V of {args.tokens} tokens x {HEADS} heads x {HEAD_DIM}, kernels for "
        f"{isa}, {args.threads} threads"
    )
    for column in ("dtype", "codec", "mode", "encode GB/s", "x memcpy", "decode GB/s",
                   "x memcpy", "payload GB/s", "ratio", "cosine", "SNR dB"):  # fmt: skip
        table.add_column(column, justify="right")
    with ThreadPoolExecutor(args.threads) as pool:
        for dtype in args.dtypes.split(","):
            kv = as_dtype(kv32, dtype)
            copy = np.empty_like(kv)
            memcpy_s = best_time(lambda kv=kv, copy=copy: np.copyto(copy, kv), args.repeats)
            memcpy = f"{kv.nbytes / memcpy_s / 1e9:.2f}"
            table.add_row(dtype, "memcpy", "", memcpy, "1.00")
            for name in args.codecs.split(","):
                for row in measure(name, kv, dtype, args, pool):
                    table.add_row(*row)
    console.print(table)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    console.print(
        f"load average at the end: {load} on {os.cpu_count()} cores (other processes sharing "
        "the cores slow the multi-threaded runs most; compare on an idle machine)"
    )
    console.print(
        "GB/s: uncompressed bytes, except payload GB/s: payload bytes consumed by decode. "
        "x memcpy: numpy memcpy time of the same bytes (measured just before) / codec time. "
        "ratio: 16-bit input bytes / payload bytes of the whole tensors (headers, scales, "
        "norms and masks included); cosine and SNR over K and V together."
    )


if __name__ == "__main__":
    main()
