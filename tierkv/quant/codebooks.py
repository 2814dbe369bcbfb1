"""TurboQuant's fixed ingredients: Lloyd–Max codebooks and seeded random rotations.

A uniformly random unit vector in m dimensions has coordinates with density
p(x) ∝ (1 - x²)^((m - 3) / 2) on [-1, 1] (Zandieh et al. 2025, arXiv 2504.19874, Lemma 1); after
a random rotation every coordinate of any unit vector follows it, so one scalar Lloyd–Max
quantizer per (m, bits) is near optimal. The codebooks are computed deterministically (Lloyd
iterations on a fine grid, float64) and cached; the rotations come from fixed seeds, so encoder
and decoder agree without storing either. Changing any of this changes the payload format.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

ROTATION_SEED = 0x74696572  # part of the payload format (versions 1 and 2)
_GRID_CELLS = 1 << 18
_MAX_ITERATIONS = 5000


@dataclass(frozen=True)
class Codebook:
    """Reconstruction levels (ascending) and the decision boundaries between them, float32."""

    centroids: np.ndarray
    boundaries: np.ndarray
    mse: float
    """Expected squared error per unit vector (m times the per-coordinate error)."""


@dataclass(frozen=True)
class Rotation:
    """y = R u: random signs, then a normalised Walsh–Hadamard transform when m is a power of two
    (`matrix` empty); otherwise, in payload format version 1, the seeded orthogonal m x m
    `matrix` (transpose in `matrix_t`), and from version 2 the Kronecker product Q ⊗ H_p of the
    seeded orthogonal q x q `matrix` Q and the normalised Hadamard transform of size p, where
    p is the largest power of two dividing m and q = m / p (the Hadamard transform runs on each
    of the q blocks of p coordinates, then Q mixes the blocks: q + log2(p) operations per value
    instead of m)."""

    signs: np.ndarray
    matrix: np.ndarray
    matrix_t: np.ndarray

    def as_matrix(self) -> np.ndarray:
        """R as a dense float64 matrix (for the torch path and for tests)."""
        m = self.signs.size
        if self.matrix.shape[0] == m:
            return self.matrix.astype(np.float64)
        q = max(1, self.matrix.shape[0])
        hadamard = np.ones((1, 1))
        while hadamard.shape[0] < m // q:
            hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
        mix = self.matrix.astype(np.float64) if q > 1 else np.ones((1, 1))
        core = np.kron(mix, hadamard / np.sqrt(m // q))
        return core * self.signs.astype(np.float64)[None, :]


def is_power_of_two(m: int) -> bool:
    return m > 0 and m & (m - 1) == 0


@cache
def lloyd_max(m: int, bits: int) -> Codebook:
    """The Lloyd–Max quantizer with 2**bits levels for a coordinate of a random unit m-vector."""
    if m < 3 or not 1 <= bits <= 8:
        raise ValueError(f"codebook needs m >= 3 and 1 <= bits <= 8, got m={m}, bits={bits}")
    edges = np.linspace(-1.0, 1.0, _GRID_CELLS + 1)
    mid = 0.5 * (edges[1:] + edges[:-1])
    log_density = 0.5 * (m - 3) * np.log1p(-mid * mid)
    weight = np.exp(log_density - log_density.max())
    weight /= weight.sum()
    cum_w = np.concatenate([[0.0], np.cumsum(weight)])
    cum_wx = np.concatenate([[0.0], np.cumsum(weight * mid)])
    levels = 1 << bits
    # Start from the quantiles' midpoints, then alternate centroid / boundary conditions.
    quantiles = np.interp((np.arange(levels) + 0.5) / levels, cum_w, edges)
    centroids = quantiles
    for _ in range(_MAX_ITERATIONS):
        bounds = np.concatenate([[-1.0], 0.5 * (centroids[1:] + centroids[:-1]), [1.0]])
        w = np.diff(np.interp(bounds, edges, cum_w))
        wx = np.diff(np.interp(bounds, edges, cum_wx))
        updated = np.where(w > 0, wx / np.maximum(w, 1e-300), centroids)
        updated = 0.5 * (updated - updated[::-1])  # the density is symmetric
        converged = np.max(np.abs(updated - centroids)) < 1e-12
        centroids = updated
        if converged:
            break
    boundaries = 0.5 * (centroids[1:] + centroids[:-1])
    cell = np.clip(np.searchsorted(boundaries, mid), 0, levels - 1)
    mse = float(m * np.sum(weight * (mid - centroids[cell]) ** 2))
    return Codebook(centroids.astype(np.float32), boundaries.astype(np.float32), mse)


@cache
def rotation(m: int, version: int) -> Rotation:
    """The seeded rotation for m-dimensional vectors in payload format `version` (same on every
    machine; version 2 differs from 1 only where m is not a power of two)."""
    rng = np.random.default_rng([ROTATION_SEED, m])
    empty = np.zeros((0, 0), np.float32)
    if is_power_of_two(m):
        signs = np.where(rng.random(m) < 0.5, -1.0, 1.0).astype(np.float32)
        return Rotation(signs, empty, empty)
    if version == 1:
        return _orthogonal(rng, m, np.ones(m, np.float32))
    signs = np.where(rng.random(m) < 0.5, -1.0, 1.0).astype(np.float32)
    return _orthogonal(rng, m // (m & -m), signs)


def _orthogonal(rng: np.random.Generator, q: int, signs: np.ndarray) -> Rotation:
    """A Rotation with `signs` and a Haar-distributed q x q orthogonal matrix drawn from `rng`."""
    q_, r = np.linalg.qr(rng.standard_normal((q, q)))
    q_ *= np.sign(np.diag(r))[None, :]
    matrix = np.ascontiguousarray(q_, dtype=np.float32)
    return Rotation(signs, matrix, np.ascontiguousarray(matrix.T))
