"""MLX encode and decode (tierkv.quant.mlx_ops) against the Numba kernels, on the same blocks.

K and V of --tokens tokens x 8 KV heads x 128 dims in EXO's layout, one [heads, --block-tokens,
dim] block of one layer at a time on one thread, as the EXO hook hands them to the tier (so the
single-threaded Numba kernels). For every codec and dtype it prints encode and decode GB/s of
uncompressed bytes for Numba (numpy arrays in and out) and for MLX (an MLX array in, an evaluated
MLX array out), MLX / Numba, and each as a fraction of numpy memcpy of the same bytes measured
in the same run. MLX runs on its default device: the CPU with mlx[cpu] on Linux (what was
measured); Metal on Apple Silicon is untested. Timings are the best of --repeats runs.

    .venv/bin/python benchmarks/bench_mlx.py [--tokens 8192] [--codecs int8,tq3] [--dtypes bf16]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from bench_codecs import HEAD_DIM, as_dtype, best_time, synthetic_kv
from rich.console import Console
from rich.table import Table

from tierkv.codecs import DTYPE_BYTES, FRAMEWORK_DTYPES
from tierkv.quant import CODEC_NAMES, decode_into, get_codec, mlx_ops, warmup

_MX_TYPES = {
    ours: getattr(mx, name) for name, ours in FRAMEWORK_DTYPES.items() if DTYPE_BYTES[ours] == 2
}
"""The 16-bit dtypes, which bench_codecs.as_dtype makes."""


def exo_blocks(kv: np.ndarray, block_tokens: int) -> list[np.ndarray]:
    """Contiguous [heads, block_tokens, dim] blocks of K, then of V ([2, tokens, heads, dim])."""
    tokens = kv.shape[1]
    return [
        np.ascontiguousarray(kv[p, t : t + block_tokens].transpose(1, 0, 2))
        for p in range(2)
        for t in range(0, tokens - block_tokens + 1, block_tokens)
    ]


def measure(name: str, blocks: list[np.ndarray], dtype: str, repeats: int) -> list[str]:
    """One table row: Numba and MLX encode and decode of every block, and memcpy."""
    codec = get_codec(name, HEAD_DIM)
    arrays = [mx.array(block).view(_MX_TYPES[dtype]) for block in blocks]
    mx.eval(arrays)
    payloads = [codec.encode(block, dtype) for block in blocks]
    outs = [np.empty_like(block) for block in blocks]
    copies = [np.empty_like(block) for block in blocks]
    nbytes = sum(block.nbytes for block in blocks)

    def memcpy() -> None:
        for block, copy in zip(blocks, copies, strict=True):
            np.copyto(copy, block)

    def numba_encode() -> None:
        for block in blocks:
            codec.encode(block, dtype)

    def mlx_encode() -> None:
        for array in arrays:
            mlx_ops.encode(codec, array)

    def numba_decode() -> None:
        for payload, out in zip(payloads, outs, strict=True):
            decode_into(payload, out)

    def mlx_decode() -> None:
        for payload in payloads:
            mx.eval(mlx_ops.decode(payload))

    memcpy_s = best_time(memcpy, repeats)
    runs = (numba_encode, mlx_encode, numba_decode, mlx_decode)
    enc_numba, enc_mlx, dec_numba, dec_mlx = (best_time(run, repeats) for run in runs)
    row = [dtype, name]
    for numba_s, mlx_s in ((enc_numba, enc_mlx), (dec_numba, dec_mlx)):
        row += [
            f"{nbytes / numba_s / 1e9:.2f} ({memcpy_s / numba_s:.2f})",
            f"{nbytes / mlx_s / 1e9:.3f} ({memcpy_s / mlx_s:.3f})",
            f"{numba_s / mlx_s:.3f}",
        ]
    return [*row, f"{nbytes / memcpy_s / 1e9:.2f}"]


def names(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of `allowed` names."""

    def parse(text: str) -> list[str]:
        unknown = [name for name in text.split(",") if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown)}; expected some of {', '.join(allowed)}"
            )
        return text.split(",")

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--codecs", type=names(CODEC_NAMES), default=list(CODEC_NAMES))
    parser.add_argument("--dtypes", type=names(tuple(_MX_TYPES)), default=["bf16", "fp16"])
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    console = Console(width=150)
    codecs, dtypes = args.codecs, args.dtypes
    warmup(codecs, dtypes, with_fidelity=False, largest_block_bytes=0)
    kv32 = synthetic_kv(args.tokens)
    table = Table(
        title=f"Numba vs MLX ({mx.default_device()}) on blocks of {args.block_tokens} tokens of "
        f"K+V of {args.tokens} tokens x 8 heads x {HEAD_DIM}, one thread"
    )
    for column in ("dtype", "codec", "Numba encode GB/s (x memcpy)", "MLX encode", "MLX / Numba",
                   "Numba decode", "MLX decode", "MLX / Numba", "memcpy GB/s"):  # fmt: skip
        table.add_column(column, justify="right")
    for dtype in dtypes:
        blocks = exo_blocks(as_dtype(kv32, dtype), args.block_tokens)
        for name in codecs:
            table.add_row(*measure(name, blocks, dtype, args.repeats))
    console.print(table)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    console.print(
        f"load average at the end: {load} on {os.cpu_count()} cores. GB/s: uncompressed bytes; "
        "x memcpy: numpy memcpy time of the same blocks (measured just before) / codec time; "
        "MLX / Numba: Numba time / MLX time (> 1: MLX is faster)."
    )


if __name__ == "__main__":
    main()
