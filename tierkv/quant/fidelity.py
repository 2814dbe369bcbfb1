"""How close a decoded block is to the original: SNR, cosine similarity, largest absolute error."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from tierkv.quant.kernels import to_f32
from tierkv.quant.payload import DTYPE_CODES, input_words


@dataclass(frozen=True)
class Fidelity:
    """snr_db = 10 log10(sum ref^2 / sum err^2); cosine over the whole block; max |ref - approx|."""

    snr_db: float
    cosine: float
    max_abs_err: float


_CHUNK_VALUES = 4096


@njit(parallel=True, nogil=True, cache=True)
def _sums(ref, approx, code):
    """(sum ref^2, sum approx^2, sum ref*approx, sum err^2, max |err|), accumulated in float64."""
    n = ref.size
    n_chunks = (n + _CHUNK_VALUES - 1) // _CHUNK_VALUES
    parts = np.zeros((n_chunks, 5), np.float64)
    for c in prange(n_chunks):
        start, stop = c * _CHUNK_VALUES, min(n, (c + 1) * _CHUNK_VALUES)
        r32 = np.empty(stop - start, np.float32)
        a32 = np.empty(stop - start, np.float32)
        to_f32(ref[start:stop], code, r32)
        to_f32(approx[start:stop], code, a32)
        rr = aa = ra = ee = mx = 0.0
        for i in range(stop - start):
            r = np.float64(r32[i])
            a = np.float64(a32[i])
            rr += r * r
            aa += a * a
            ra += r * a
            ee += (r - a) * (r - a)
            mx = max(mx, abs(r - a))
        parts[c, 0], parts[c, 1], parts[c, 2], parts[c, 3], parts[c, 4] = rr, aa, ra, ee, mx
    totals = parts.sum(axis=0)
    return totals[0], totals[1], totals[2], totals[3], parts[:, 4].max() if n_chunks else 0.0


def fidelity(ref: np.ndarray, approx: np.ndarray, dtype: str | None = None) -> Fidelity:
    """Compare a decoded block with its original (same shape and element type).

    Identical blocks give snr_db=inf, cosine=1. A zero block against a non-zero one has cosine 0.
    """
    if ref.shape != approx.shape:
        raise ValueError(f"fidelity needs equal shapes, got {ref.shape} and {approx.shape}")
    ref_words, dtype = input_words(ref, dtype)
    approx_words, _ = input_words(approx, dtype)
    rr, aa, ra, ee, mx = _sums(ref_words, approx_words, DTYPE_CODES[dtype])
    snr = math.inf if ee == 0.0 else (10.0 * math.log10(rr / ee) if rr > 0.0 else -math.inf)
    degenerate = rr == 0.0 or aa == 0.0
    cosine = (1.0 if rr == aa else 0.0) if degenerate else ra / math.sqrt(rr * aa)
    return Fidelity(snr_db=snr, cosine=cosine, max_abs_err=mx)
