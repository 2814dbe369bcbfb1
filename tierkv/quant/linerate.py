"""Which link speed this CPU's decode of a lossy codec sustains, measured at start.

A compressed restore pipelines the link (stored bytes) behind the decoder (ColdTier.load), so a
codec pays only while its decode keeps up with the link: past the decoder's payload rate D the
link waits on the CPU, and past D x ratio a lossless restore (the raw bytes at line rate, no
decode) would be sooner. The connector and the EXO hook log that once, after their warm-up, so a
user on a fast link with a narrow-vector CPU sees when to choose a lighter codec or none.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tierkv.logs import get_logger
from tierkv.quant.base import Codec
from tierkv.quant.codec import decode_into, decode_many, encode_block
from tierkv.quant.target import instruction_set

_SAMPLE_BLOCKS = 16
"""Blocks per decode thread in the measurement: a run as a Promote delivers it."""
_SAMPLE_TOKENS, _SAMPLE_HEADS = 64, 8
"""Each block: [tokens, heads, group_size] values (64 x 8 x 128 fp16: 128 KB)."""
_REPEATS = 5

log = get_logger(__name__)


@dataclass(frozen=True)
class LineRate:
    """A codec's measured decode on this CPU: `payload_gbps` of payload consumed on `threads`
    threads, `ratio` raw bytes per payload byte."""

    codec: str
    payload_gbps: float
    ratio: float
    threads: int

    def keeps_up_gbit(self) -> float:
        """The fastest link (Gbit/s) whose stored bytes the decoder consumes as they arrive."""
        return 8 * self.payload_gbps

    def beats_lossless_gbit(self) -> float:
        """The fastest link (Gbit/s) on which this codec restores no later than lossless."""
        return 8 * self.payload_gbps * self.ratio

    def __str__(self) -> str:
        return (
            f"{self.codec} decode on this CPU ({instruction_set()}) sustains "
            f"{self.payload_gbps:.2f} GB/s of payload on {self.threads} threads: it keeps up "
            f"with links up to {self.keeps_up_gbit():.0f} Gb/s and restores no slower than "
            f"lossless up to {self.beats_lossless_gbit():.0f} Gb/s (on a faster link, "
            'codec = "none" restores sooner)'
        )


def measure_line_rate(codec: Codec, dtype: str, threads: int = 2) -> LineRate | None:
    """Time `threads` threads each decoding a run of payloads of `codec` into reused staging, as
    ColdTier.load does (best of a few; tens of milliseconds); None for the lossless codec."""
    if codec.name == "none":
        return None
    rng = np.random.default_rng(0)
    shape = (_SAMPLE_TOKENS, _SAMPLE_HEADS, codec.group_size)
    values = rng.standard_normal(shape, dtype=np.float32)
    block: np.ndarray = values if dtype == "fp32" else values.astype(np.float16)
    if dtype == "bf16":  # bf16 as its words, truncated (any values will do)
        block = (values.view(np.uint32) >> 16).astype(np.uint16)
    payload = encode_block(codec, block, dtype, kv_split=(1, _SAMPLE_HEADS // 2))
    run = memoryview(bytes(payload) * _SAMPLE_BLOCKS)
    payloads = [run[i * len(payload) : (i + 1) * len(payload)] for i in range(_SAMPLE_BLOCKS)]
    rows = list(range(_SAMPLE_BLOCKS))
    staging = [np.zeros((_SAMPLE_BLOCKS, *shape), block.dtype) for _ in range(threads)]

    def decode(out: np.ndarray) -> None:
        done = decode_many(payloads, out, rows)
        for row in np.flatnonzero(~done):  # what decode_many leaves (pairs), one by one
            decode_into(payloads[row], out[row])

    with ThreadPoolExecutor(threads) as pool:
        best = float("inf")
        for _ in range(_REPEATS + 1):  # the first round warms caches and staging
            start = time.perf_counter()
            list(pool.map(decode, staging))
            best = min(best, time.perf_counter() - start)
    stored = threads * len(run)
    return LineRate(codec.name, stored / best / 1e9, block.nbytes / len(payload), threads)


def line_rate_note(codec: Codec, dtype: str) -> str | None:
    """The start-up log line for `codec`: None for the lossless codec, and where measuring
    fails (a log line never stops an engine from starting)."""
    try:
        rate = measure_line_rate(codec, dtype)
    except Exception:
        log.warning("could not measure %s decode speed", codec.name, exc_info=True)
        return None
    return None if rate is None else str(rate)
