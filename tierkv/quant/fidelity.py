"""How close a decoded block is to the original: SNR, cosine similarity, largest absolute error."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from tierkv.codecs import DTYPE_CODES
from tierkv.quant.kernels import CHUNK_VALUES, Threaded, to_f32
from tierkv.quant.payload import input_words


@dataclass(frozen=True)
class Fidelity:
    """snr_db = 10 log10(sum ref^2 / sum err^2); cosine over the whole block; max |ref - approx|."""

    snr_db: float
    cosine: float
    max_abs_err: float


@njit(cache=True, nogil=True)
def _sums_range(ref, approx, code, start, stop, sums):
    """Add sum ref^2, sum approx^2, sum ref*approx, sum err^2 over [start, stop) to sums[:4] and
    fold max |err| into sums[4] (float64)."""
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
    sums[0] += rr
    sums[1] += aa
    sums[2] += ra
    sums[3] += ee
    sums[4] = max(sums[4], mx)


@njit(cache=True, nogil=True)
def _sums_serial(ref, approx, code):
    sums = np.zeros(5, np.float64)
    for start in range(0, ref.size, CHUNK_VALUES):
        _sums_range(ref, approx, code, start, min(ref.size, start + CHUNK_VALUES), sums)
    return sums


@njit(parallel=True, nogil=True, cache=True)
def _sums_parallel(ref, approx, code):
    n_chunks = (ref.size + CHUNK_VALUES - 1) // CHUNK_VALUES
    parts = np.zeros((n_chunks, 5), np.float64)
    for c in prange(n_chunks):
        start = c * CHUNK_VALUES
        _sums_range(ref, approx, code, start, min(ref.size, start + CHUNK_VALUES), parts[c])
    sums = parts.sum(axis=0)
    if n_chunks:
        sums[4] = parts[:, 4].max()
    return sums


_sums = Threaded(_sums_serial, _sums_parallel)


def fidelity(ref: np.ndarray, approx: np.ndarray, dtype: str | None = None) -> Fidelity:
    """Compare a decoded block with its original (same shape and element type).

    Identical blocks give snr_db=inf, cosine=1. A zero block against a non-zero one has cosine 0.
    """
    if ref.shape != approx.shape:
        raise ValueError(f"fidelity needs equal shapes, got {ref.shape} and {approx.shape}")
    ref_words, dtype = input_words(ref, dtype)
    approx_words, _ = input_words(approx, dtype)
    sums = _sums(ref_words.nbytes, ref_words, approx_words, DTYPE_CODES[dtype])
    rr, aa, ra, ee, mx = (float(v) for v in sums)
    snr = math.inf if ee == 0.0 else (10.0 * math.log10(rr / ee) if rr > 0.0 else -math.inf)
    degenerate = rr == 0.0 or aa == 0.0
    cosine = (1.0 if rr == aa else 0.0) if degenerate else ra / math.sqrt(rr * aa)
    return Fidelity(snr_db=snr, cosine=cosine, max_abs_err=mx)
