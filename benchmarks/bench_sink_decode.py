"""Decode speed of the sink codecs beside tq4 and memcpy, in per-thread CPU time.

One block at a time on one thread, as ColdTier's load decodes a block it cannot batch: every
codec and memcpy of the same bytes are timed interleaved, round after round, and each keeps its
best round, in CPU seconds of this thread (time.thread_time), so other processes sharing the
cores change the figures far less than wall-clock ones. Blocks: SmolLM2's [128 tokens, 3 heads,
64] and [256, 8, 128], bf16, keys with a per-channel offset.

    .venv/bin/python benchmarks/bench_sink_decode.py   # NUMBA_CPU_NAME=haswell for AVX2 builds
"""

from __future__ import annotations

import time

import numpy as np

from tierkv.quant import decode_into, encode_block, get_codec, warmup
from tierkv.quant.target import instruction_set

CODECS = ("tq4", "tq4c", "tq4s", "tq3", "tq3c", "tq5c")
SHAPES = ((128, 3, 64), (256, 8, 128))
ROUNDS = 7


def main() -> None:
    warmup(CODECS, ["bf16"], largest_block_bytes=0)
    print(f"kernels for {instruction_set()}; decode GB/s of bf16 output per CPU second")
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        x = (rng.standard_normal(shape) + 3 * rng.standard_normal(shape[1:])).astype(np.float32)
        words = (x.view(np.uint32) >> 16).astype(np.uint16)
        payloads = {
            name: encode_block(get_codec(name, shape[-1]), words, "bf16", sink_tokens=(0, 0))
            for name in CODECS
        }
        out, copy = np.empty_like(words), np.empty_like(words)
        repeats = max(20, 50_000_000 // words.nbytes)
        best = dict.fromkeys(("memcpy", *CODECS), float("inf"))
        for _ in range(ROUNDS):
            for name in best:
                start = time.thread_time()
                for _ in range(repeats):
                    if name == "memcpy":
                        np.copyto(copy, words)
                    else:
                        decode_into(payloads[name], out)
                best[name] = min(best[name], (time.thread_time() - start) / repeats)
        figures = "  ".join(f"{name} {words.nbytes / s / 1e9:.2f}" for name, s in best.items())
        print(f"{shape} ({words.nbytes} bytes): {figures}")


if __name__ == "__main__":
    main()
