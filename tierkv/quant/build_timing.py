"""The timing child of tierkv.kernel_builds: `python -m tierkv.quant.build_timing CODEC` prints
the best seconds its kernels, in the build this process runs (NUMBA_CPU_NAME), take to encode and
decode a short sample."""

from __future__ import annotations

import sys
import time

import numpy as np

from tierkv.quant import decode_into, encode_block, get_codec

SAMPLE_SHAPE = (256, 8, 128)
"""One block of the sample: 256 tokens of 8 KV heads of 128 dims (fp16: 512 KiB)."""
SAMPLE_BLOCKS = 8
TIMED_RUNS = 3


def time_sample(codec_name: str) -> float:
    """Best seconds of TIMED_RUNS rounds of encoding and decoding the sample, one block at a
    time as ColdTier does, after one round that compiles (or loads) the kernels."""
    codec = get_codec(codec_name, SAMPLE_SHAPE[-1])
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal(SAMPLE_SHAPE).astype(np.float16) for _ in range(SAMPLE_BLOCKS)]
    out = np.empty_like(blocks[0])
    best = float("inf")
    for _ in range(TIMED_RUNS + 1):
        started = time.perf_counter()
        for block in blocks:
            decode_into(encode_block(codec, block, "fp16", kv_split=(1, 4)), out)  # pairs too
        best = min(best, time.perf_counter() - started)
    return best


if __name__ == "__main__":
    print(time_sample(sys.argv[1]))
