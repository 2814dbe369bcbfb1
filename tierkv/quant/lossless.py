"""The `none` codec: the block's own bytes behind a header (bit-exact), after a finiteness check."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tierkv.quant.kernels import CHUNK_VALUES, Threaded, max_abs_bits, nonfinite_bits
from tierkv.quant.payload import DTYPE_CODES, NonFiniteError, input_words, pack_header


@njit(cache=True, nogil=True)
def count_nonfinite_serial(words, code):
    """1 when `words` (dtype `code`) holds a NaN or Inf, else 0."""
    return int(max_abs_bits(words, code) >= nonfinite_bits(code))


@njit(parallel=True, nogil=True, cache=True)
def count_nonfinite_parallel(words, code):
    """Number of chunks of `words` (dtype `code`) that hold a NaN or Inf."""
    n_chunks = (words.size + CHUNK_VALUES - 1) // CHUNK_VALUES
    bad = 0
    for c in prange(n_chunks):
        chunk = words[c * CHUNK_VALUES : (c + 1) * CHUNK_VALUES]
        bad += max_abs_bits(chunk, code) >= nonfinite_bits(code)
    return bad


count_nonfinite = Threaded(count_nonfinite_serial, count_nonfinite_parallel)


def check_finite(words: np.ndarray, dtype: str) -> None:
    """Raise NonFiniteError when `words` holds a NaN or Inf."""
    if count_nonfinite(words.nbytes, words, DTYPE_CODES[dtype]):
        raise NonFiniteError(f"block of {words.size} values holds NaN/Inf")


class LosslessCodec:
    """Stores the block bit-exact (payload = header + raw little-endian words)."""

    name = "none"

    def __init__(self, group_size: int = 128) -> None:
        if not 1 <= group_size <= 1 << 20:  # unused here, but recorded in the header
            raise ValueError(f"none group_size must be in [1, 2**20], got {group_size}")
        self.group_size = group_size

    def encode(self, src: np.ndarray, dtype: str | None = None) -> bytes:
        words, dtype = input_words(src, dtype)
        check_finite(words, dtype)
        header = pack_header(self.name, dtype, tuple(src.shape), self.group_size, words.nbytes)
        return b"".join((header, words.data.cast("B")))


def decode_body(body: np.ndarray, out_words: np.ndarray) -> None:
    """Copy the raw words of `body` into `out_words` (sizes already checked)."""
    np.copyto(out_words, body.view(out_words.dtype))
