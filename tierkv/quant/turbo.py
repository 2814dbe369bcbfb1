"""TurboQuant codecs: tq4, tq3, tq2 and the mixed-precision tq3.5 and tq2.5.

Each vector of d = group_size values (one head's key or value for one token) is quantized as in
Zandieh et al. 2025 (arXiv 2504.19874): store its norm, rotate the normalised vector with the
seeded rotation of `codebooks`, quantize every coordinate with the Lloyd–Max codebook for that
dimension and bit width, bit-pack the indices. Decode looks the levels up, rotates back and scales.

Mixed modes split the channels into two instances: per selection group (a head, see
`selection_groups`) the d/4 channels with the most energy in the block (32 of 128) get `hi` bits,
the other 3d/4 get `lo` bits; each instance has its own norm, rotation and codebook. tq3.5 is
32 @ 5 + 96 @ 3 bits, tq2.5 is 32 @ 4 + 96 @ 2.

Body: block exponent k (int16)
      | mixed only: per selection group a bit mask of its hi channels (ceil(d/8) bytes)
      | per vector and instance an fp16 norm (times 2**-k, so any fp32 norm fits)
      | per vector its indices: hi instance then lo, each packed LSB-first in groups of 8
        (`bits` bytes per group, a last partial group padded to a byte).
The element count must be a multiple of d (else encode raises ValueError).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import njit, prange

from tierkv.codecs import DTYPE_CODES, TURBO_MODES
from tierkv.quant.base import CodecFamily
from tierkv.quant.codebooks import Codebook, Rotation, lloyd_max, rotation
from tierkv.quant.hadamard import butterflies
from tierkv.quant.kernels import (
    BF16,
    CHUNK_VALUES,
    EXPAND_LANES,
    FP16,
    FP32,
    TRANSPOSE,
    Threaded,
    bf16_round,
    bf16_word,
    bits_value,
    block_exponent,
    compress_split,
    copy_u64_pair,
    expand_merge,
    expands,
    f32_to_half,
    fp16_word,
    fp32_word,
    half_to_f32,
    load_u64,
    max_abs_bits,
    max_finite,
    nonfinite_bits,
    pow2,
    read_u16,
    store_le,
    to_f32,
    transpose_block,
    write_u16,
)
from tierkv.quant.payload import (
    FORMAT_VERSION,
    NonFiniteError,
    PayloadError,
    PayloadHeader,
    PayloadRun,
    input_words,
    new_payload,
    pack_header,
)

_ENERGY_CHUNK_VALUES = 1 << 17
"""Values per work item of the energy scan (each keeps its own per-channel sums)."""
_TILE_VALUES = 1 << 14
"""Values encoded or decoded together, pass by pass over the tile of _TILE_VALUES // d vectors
(128 of 128): the encoder lays them out as columns so its inner loops run across vectors; the
decoder looks up every vector's levels, then rotates them back, then converts them."""


def check_group_size(name: str, group_size: int) -> None:
    """TurboQuant works on vectors of 16..1024 values, a multiple of 8."""
    if not (16 <= group_size <= 1024 and group_size % 8 == 0):
        raise ValueError(
            f"{name} needs group_size to be a multiple of 8 in [16, 1024], got {group_size}"
        )


def selection_groups(shape: tuple[int, ...]) -> tuple[int, int]:
    """(div, mod): vector v belongs to channel-selection group (v // div) % mod.

    A block [..., a, b, d] holds more tokens than KV heads, so the shorter of a and b is taken as
    the head axis (ties: b), which fits both vLLM's [tokens, heads, d] and MLX's
    [heads, tokens, d]. Blocks of fewer than three dimensions form a single group.
    """
    if len(shape) < 3:
        return 1, 1
    a, b = shape[-3], shape[-2]
    return (1, b) if b <= a else (b, a)


class Instance:
    """One quantizer: `m` channels at `bits` bits, with its rotation and codebook."""

    def __init__(self, m: int, bits: int, version: int) -> None:
        self.m = m
        self.bits = bits
        self.rotation: Rotation = rotation(m, version)
        self.codebook: Codebook = lloyd_max(m, bits)
        self.table = decode_table(self.codebook.centroids, m, bits, self.rotation.matrix.shape[0])

    def kernel_args(self) -> tuple[object, ...]:
        r, c = self.rotation, self.codebook
        return (self.m, self.bits, r.signs, r.matrix, r.matrix_t, self.table, c.boundaries)


def decode_table(centroids: np.ndarray, m: int, bits: int, q: int) -> np.ndarray:
    """The decoder's look-up table: per byte of 4 indices of 2 bits (when m is a multiple of 4)
    or per pair of indices (2 * bits bits, first index lowest), their levels; with the rotation's
    first Walsh-Hadamard butterfly stages (of coordinate distance 1, and 2 for 4 levels) already
    applied when the transform starts with them (a single Hadamard block, q <= 1). float32
    arithmetic, as the kernel's butterflies, so a decode is bit for bit what it was without."""
    c = centroids.astype(np.float32)
    mask = (1 << bits) - 1
    per_entry = 4 if bits == 2 and m % 4 == 0 else 2
    codes = np.arange(1 << (bits * per_entry))
    v = [c[(codes >> (bits * i)) & mask] for i in range(per_entry)]
    if q <= 1:
        v = [v[0] + v[1], v[0] - v[1], *v[2:]]
        if per_entry == 4:
            s2, s3 = v[2] + v[3], v[2] - v[3]
            v = [v[0] + s2, v[1] + s3, v[0] - s2, v[1] - s3]
    return np.ascontiguousarray(np.stack(v, axis=1), dtype=np.float32)


_NO_INSTANCE = (
    0,
    0,
    np.zeros(0, np.float32),
    np.zeros((0, 0), np.float32),
    np.zeros((0, 0), np.float32),
    np.zeros((1, 2), np.float32),
    np.zeros(0, np.float32),
)


NO_CENTRE = (np.zeros(0, np.uint8), 1, 1)
"""The decoders' `centre` of a codec that adds no means (see _to_words)."""


class Layout:
    """Byte offsets of a TurboQuant body for `n_vectors` vectors of d values."""

    def __init__(self, d: int, hi: Instance, lo: Instance | None, shape: tuple[int, ...]) -> None:
        n = math.prod(shape)
        self.n_vectors = n // d
        self.sel_div, self.sel_mod = selection_groups(shape) if lo else (1, 1)
        self.mask_bytes = (d + 7) // 8 if lo else 0
        self.n_instances = 2 if lo else 1
        self.norms_offset = 2 + self.sel_mod * self.mask_bytes
        self.indices_offset = self.norms_offset + 2 * self.n_instances * self.n_vectors
        self.bytes_per_vector = int(packed_bytes(hi.m, hi.bits)) + (
            int(packed_bytes(lo.m, lo.bits)) if lo else 0
        )
        self.body_bytes = self.indices_offset + self.bytes_per_vector * self.n_vectors
        self.offsets = (self.norms_offset, self.indices_offset, self.bytes_per_vector)


@njit(cache=True, nogil=True, inline="always")
def _radix4(y, r0, r1, r2, r3, n):
    """Two Walsh-Hadamard butterfly stages on the four runs of n lanes at y[r0:], y[r1:],
    y[r2:], y[r3:] (run 0 + run 1, run 0 - run 1, the same for runs 2 and 3, then across the
    pairs), in place."""
    for t in range(n):
        a0, a1 = np.uint64(r0 + t), np.uint64(r1 + t)
        a2, a3 = np.uint64(r2 + t), np.uint64(r3 + t)
        s0 = y[a0] + y[a1]
        s1 = y[a0] - y[a1]
        s2 = y[a2] + y[a3]
        s3 = y[a2] - y[a3]
        y[a0] = s0 + s2
        y[a1] = s1 + s3
        y[a2] = s0 - s2
        y[a3] = s1 - s3


@njit(cache=True, nogil=True)
def _fwht_columns(y, m, n):
    """Unnormalised fast Walsh–Hadamard transform of each column y[:m, t], t < n (in place).

    Two butterfly stages per pass over the tile (radix 4), then a last radix-2 stage when
    log2(m) is odd: half the passes of the textbook loop, twice as fast. (Rows are addressed
    in the flat array, here and in the encoder's other passes over a tile: a view per row
    would cost two atomic reference counts; and with unsigned indices, which Numba does not
    check for wraparound.)"""
    flat, w = y.reshape(-1), y.shape[1]
    h = 1
    while 4 * h <= m:
        for i in range(0, m, 4 * h):
            for j in range(i, i + h):
                _radix4(flat, j * w, (j + h) * w, (j + 2 * h) * w, (j + 3 * h) * w, n)
        h *= 4
    if h < m:
        for j in range(h):
            for t in range(n):
                a0, a1 = np.uint64(j * w + t), np.uint64((j + h) * w + t)
                a = flat[a0]
                b = flat[a1]
                flat[a0] = a + b
                flat[a1] = a - b


@njit(cache=True, nogil=True)
def _mix_columns(y, z, mix, p):
    """z = y with its q = mix.shape[0] blocks of p rows mixed: block a of z is
    sum_b mix[a, b] * block b of y (summed in order of b from 0). Whole blocks of rows at a
    time (the columns past a partial tile's vectors are mixed too, and never read)."""
    q = mix.shape[0]
    size = p * y.shape[1]
    flat_y, flat_z = y.reshape(-1), z.reshape(-1)
    for a in range(q):
        dst = flat_z[a * size : (a + 1) * size]
        c = mix[a, 0]
        for i in range(size):
            dst[i] = np.float32(0.0) + c * flat_y[i]
        for b in range(1, q):
            c = mix[a, b]
            src = flat_y[b * size : (b + 1) * size]
            for i in range(size):
                dst[i] += c * src[i]


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _dot(a, a_at, b, b_at, m):
    """sum(a[a_at : a_at + m] * b[b_at : b_at + m]) of 1-D arrays in float32 (reassociated, so it
    vectorizes; unsigned indices and no views: no wraparound checks, no reference counts)."""
    acc = np.float32(0.0)
    for j in range(m):
        acc += a[np.uint64(a_at + j)] * b[np.uint64(b_at + j)]
    return acc


@njit(cache=True, nogil=True)
def _transpose(rows, offset, n, m, columns):
    """columns[j, t] = rows[t, offset + j] for t < n, j < m (C-contiguous 2-D float32): whole
    blocks with transpose_block, the edges one by one."""
    flat_rows, flat_columns = rows.reshape(-1), columns.reshape(-1)
    row_stride, column_stride = rows.shape[1], columns.shape[1]
    n_whole, m_whole = n - n % TRANSPOSE, m - m % TRANSPOSE
    for t in range(0, n_whole, TRANSPOSE):
        for j in range(0, m_whole, TRANSPOSE):
            at, to = t * row_stride + offset + j, j * column_stride + t
            transpose_block(flat_rows, at, row_stride, flat_columns, to, column_stride)
    for j in range(m):
        for t in range(n_whole if j < m_whole else 0, n):
            columns[j, t] = rows[t, offset + j]


@njit(cache=True, nogil=True)
def _pack(idx, m, n, bits, out, start, stride):
    """Bit-pack idx[:m, t] for each vector t into out[start + t * stride:], LSB first, in groups
    of 8 indices (bits bytes each; a last partial group is padded to a byte). Each group is
    assembled for the whole tile at once (across vectors); then, vector by vector and in
    order, each group is stored as one 8-byte word whose bytes past the group the next groups
    overwrite, and the groups too close to the vector's end 4, 2 and 1 bytes at a time."""
    n_groups = (m + 7) // 8
    groups = np.zeros((n_groups, n), np.uint64)
    flat, w = idx.reshape(-1), idx.shape[1]
    for g in range(n_groups):
        for i in range(min(8, m - 8 * g)):
            row, shift = (8 * g + i) * w, np.uint64(bits * i)
            for t in range(n):
                groups[g, t] |= np.uint64(flat[np.uint64(row + t)]) << shift
    total = packed_bytes(m, bits)
    whole = min(m // 8, max(0, (total - 8) // bits + 1))  # groups whose 8 bytes fit
    for t in range(n):
        pos = start + t * stride
        for g in range(whole):
            store_le(out, pos + g * bits, groups[g, t])
        for g in range(whole, n_groups):
            acc, at, done = groups[g, t], pos + g * bits, 0
            n_bytes = (min(8, m - 8 * g) * bits + 7) // 8
            while n_bytes - done >= 4:
                store_le(out, at + done, np.uint32(acc >> np.uint64(8 * done)))
                done += 4
            if n_bytes - done >= 2:
                store_le(out, at + done, np.uint16(acc >> np.uint64(8 * done)))
                done += 2
            if n_bytes > done:
                out[at + done] = np.uint8(acc >> np.uint64(8 * done))


@njit(cache=True, nogil=True)
def packed_bytes(m, bits):
    """Bytes of m indices at `bits` bits packed by _pack."""
    return (m // 8) * bits + ((m % 8) * bits + 7) // 8


@njit(cache=True, nogil=True, inline="always")
def _count_above(y, m, n, boundaries, count, idx):
    """idx[j, t] = how many of the first `count` boundaries y[j, t] exceeds, for j < m, t < n.
    Inlined with `count` a constant, the loop over boundaries unrolls and the one across
    vectors vectorizes (holding the count in a register instead of in idx)."""
    flat_y, flat_idx, w = y.reshape(-1), idx.reshape(-1), y.shape[1]
    for j in range(m):
        for t in range(n):
            value = flat_y[np.uint64(j * w + t)]
            above = np.int32(0)
            for b in range(count):
                above += value > boundaries[b]
            flat_idx[np.uint64(j * w + t)] = above


@njit(cache=True, nogil=True)
def _quantize(y, m, n, boundaries, idx):
    """The codebook index of each coordinate y[j, t] (j < m, t < n) in idx: the number of
    decision boundaries it exceeds. One _count_above per codebook size in use (3, 7, 15 and 31
    boundaries: 2 to 5 bits), so each has a constant loop count."""
    size = boundaries.size
    if size == 3:
        _count_above(y, m, n, boundaries, 3, idx)
    elif size == 7:
        _count_above(y, m, n, boundaries, 7, idx)
    elif size == 15:
        _count_above(y, m, n, boundaries, 15, idx)
    elif size == 31:
        _count_above(y, m, n, boundaries, 31, idx)
    else:
        _count_above(y, m, n, boundaries, size, idx)


@njit(cache=True, nogil=True)
def _encode_tile(vectors, offset, n, inst, scratch, out, at):
    """Norms and packed indices of one instance for the n vectors of a tile: vector t's channels
    of the instance in vectors[t, offset : offset + m] (already scaled by 2**-k; gathered in the
    order of its selection group when mixed); inst = (m, bits, signs, matrix, matrix_t,
    centroids, boundaries); scratch = (y, z, idx, norms); at = (first norm, norm stride, first
    index byte, index stride) in out.

    The rotated coordinates land in y[:m, :n], one column per vector, so quantizing and the
    Walsh-Hadamard butterflies run across vectors. (Only format 2 is written: its rotations are
    Hadamard blocks, never format 1's dense matrices.)"""
    m, bits, signs, matrix, _, _, boundaries = inst
    y, z, idx, inv_norms = scratch
    norm_at, norm_stride, index_at, index_stride = at
    flat = vectors.reshape(-1)
    d = vectors.shape[1]
    for t in range(n):
        norm = np.sqrt(_dot(flat, t * d + offset, flat, t * d + offset, m))
        write_u16(out, norm_at + t * norm_stride, f32_to_half(norm))
        inv_norms[t] = np.float32(1.0) / norm if norm > 0 else np.float32(0.0)
    q = max(1, matrix.shape[0])  # Hadamard blocks (payload format 2), mixed when several
    p = m // q
    scale = np.float32(1.0 / math.sqrt(p))
    _transpose(vectors, offset, n, m, y)
    columns, w = y.reshape(-1), y.shape[1]
    for j in range(m):
        f = signs[j] * scale
        for t in range(n):
            cell = np.uint64(j * w + t)
            columns[cell] = columns[cell] * inv_norms[t] * f
    for a in range(q):
        _fwht_columns(y[a * p : (a + 1) * p], p, n)
    if q > 1:
        _mix_columns(y, z, matrix, p)
        y = z
    _quantize(y, m, n, boundaries, idx)
    _pack(idx, m, n, bits, out, index_at, index_stride)


@njit(cache=True, nogil=True)
def _unpack(body, v0, n, inst, index_at, stride, pairs, at, vector_step):
    """Look up the packed indices of vectors v0 .. v0 + n - 1 (vector v's at body[index_at + v *
    stride]) in the instance's table: coordinates (2r, 2r + 1) of vector v0 + t become the
    float32 pair pairs[at + t * vector_step + r] (uint64), so each vector's levels lie in
    coordinate order. A table of 4 values per entry covers a byte (4 indices of 2 bits: both
    pairs in one 16-byte move), one of 2 a pair of indices. (Unsigned indices: see
    _rotate_back.)"""
    m, bits, _, _, _, table, _ = inst
    lanes = table.reshape(-1).view(np.uint64)  # one 64-bit move per pair of coordinates
    if table.shape[1] == 4:
        for t in range(n):
            pos, dst = index_at + (v0 + t) * stride, at + t * vector_step
            for i in range(m // 4):
                code = 2 * np.intp(body[np.uint64(pos + i)])
                copy_u64_pair(lanes, code, pairs, dst + 2 * i)
    elif bits == 4:
        for t in range(n):
            pos, dst = index_at + (v0 + t) * stride, at + t * vector_step
            for r in range(m // 2):
                pairs[np.uint64(dst + r)] = lanes[body[np.uint64(pos + r)]]
    else:
        pair_bits = np.uint64(2 * bits)
        pair_mask = np.uint64((1 << (2 * bits)) - 1)
        whole = m // 8  # groups of 8 indices: one 64-bit load, 4 look-ups
        for t in range(n):
            pos, dst = index_at + (v0 + t) * stride, at + t * vector_step
            loaded = whole if pos + (whole - 1) * bits + 8 <= body.size else 0
            for k in range(loaded):
                acc = load_u64(body, pos + k * bits)
                pairs[np.uint64(dst + 4 * k)] = lanes[acc & pair_mask]
                pairs[np.uint64(dst + 4 * k + 1)] = lanes[(acc >> pair_bits) & pair_mask]
                pairs[np.uint64(dst + 4 * k + 2)] = lanes[(acc >> (2 * pair_bits)) & pair_mask]
                pairs[np.uint64(dst + 4 * k + 3)] = lanes[(acc >> (3 * pair_bits)) & pair_mask]
            for g in range(8 * loaded, m, 8):  # the rest byte by byte
                count = min(8, m - g)
                first = pos + (g // 8) * bits
                acc = np.uint64(0)
                for byte in range((count * bits + 7) // 8):
                    acc |= np.uint64(body[np.uint64(first + byte)]) << np.uint64(8 * byte)
                for k in range(count // 2):
                    pair = lanes[(acc >> (pair_bits * np.uint64(k))) & pair_mask]
                    pairs[np.uint64(dst + g // 2 + k)] = pair


@njit(cache=True, nogil=True)
def _block_scale(inst):
    """The normalisation 1 / sqrt(p) of the instance's Hadamard blocks of p coordinates."""
    m, matrix = inst[0], inst[3]
    return np.float32(1.0 / math.sqrt(m // max(1, matrix.shape[0])))


@njit(cache=True, nogil=True)
def _mix(y, d, n, off, z, mix, p):
    """For each of the n vectors t of a tile, z[t * d + off :][: q * p] = the q = mix.shape[0]
    blocks of p values of y[t * d + off :] mixed: block a of z is sum over b of mix[a, b] *
    block b, summed in order of b from 0 (for the q = 3 of every power-of-two head dim, all three
    in one loop, in registers)."""
    q = mix.shape[0]
    zero = np.float32(0.0)
    if q == 3:
        c00, c01, c02 = mix[0, 0], mix[0, 1], mix[0, 2]
        c10, c11, c12 = mix[1, 0], mix[1, 1], mix[1, 2]
        c20, c21, c22 = mix[2, 0], mix[2, 1], mix[2, 2]
        for t in range(n):
            at = t * d + off
            for i in range(p):
                y0 = y[np.uint64(at + i)]
                y1 = y[np.uint64(at + p + i)]
                y2 = y[np.uint64(at + 2 * p + i)]
                z[np.uint64(at + i)] = zero + c00 * y0 + c01 * y1 + c02 * y2
                z[np.uint64(at + p + i)] = zero + c10 * y0 + c11 * y1 + c12 * y2
                z[np.uint64(at + 2 * p + i)] = zero + c20 * y0 + c21 * y1 + c22 * y2
        return
    for t in range(n):
        at = t * d + off
        for a in range(q):
            c = mix[a, 0]
            for i in range(p):
                z[np.uint64(at + a * p + i)] = zero + c * y[np.uint64(at + i)]
            for b in range(1, q):
                c = mix[a, b]
                for i in range(p):
                    z[np.uint64(at + a * p + i)] += c * y[np.uint64(at + b * p + i)]


@njit(cache=True, nogil=True)
def _rotate_back(y, d, n, off, z, inst):
    """Undo the rotation of one instance of the n vectors of a tile, up to the factor
    _block_scale and R's signs: vector t's levels lie in y[t * d + off :] (from _unpack).
    Hadamard blocks are rotated in place, their butterflies starting past the stages the
    look-up table did; q > 1 of them are first mixed (_mix, by matrix_t) into the same place of
    z, and a dense matrix (payload format version 1) multiplies into z. Which array holds the
    result is returned. (Indices are cast to unsigned, here and in the other passes over a tile,
    so Numba checks none for wraparound and the loops vectorize; and each pass takes the whole
    tile: a view or a call per vector would cost two atomic reference counts of each array.)"""
    m, _, _, matrix, matrix_t, table, _ = inst
    q = max(1, matrix.shape[0])
    p = m // q
    if q == 1:
        butterflies(y, off, d, n, m, table.shape[1])
        return y
    if q == m:
        dense = matrix_t.reshape(-1)
        for t in range(n):
            at = t * d + off
            for i in range(m):
                z[at + i] = _dot(dense, i * m, y, at, m)
        return z
    _mix(y, d, n, off, z, matrix_t, p)
    for a in range(q):
        butterflies(z, off + a * p, d, n, p, 1)
    return z


@njit(cache=True, nogil=True)
def _to_words(src, d, v0, n, off, inst, body, norms, pow2k, code, scaling, dst, direct, centre):
    """Scale and convert one instance of the n vectors of a tile from _rotate_back: the m values
    at src[t * d + off :] times factors[j] (1 / sqrt(p) with R's sign j, from _scale_factors),
    the norm at body[norms[0] + (v0 + t) * norms[1]] and 2**k (rounded product by product, left
    to right) in dtype `code`, to dst[(v0 + t) * d :] when direct, else to the same place as in
    src; scaling = (factors, reach). Clamped to the dtype's finite range, except for the vectors
    whose norm times reach (from _reach) is under 1: by _peak's bound every value lies within
    it (the clamp takes a quarter of the pass; skipping it where it cannot act changes no
    bit). centre = (means, iv, tokens, mean_reach): with means (a centred codec, one instance;
    rows of d), vector v gets row (v // (iv * tokens)) * iv + v % iv added, and mean_reach (the
    largest |mean| over the dtype's largest finite value) counts in the clamp test."""
    factors, reach = scaling
    at = (v0, n, off, inst[0], direct, reach)
    if centre[0].size:
        if code == FP16:
            _centred_words(src, d, at, body, norms, pow2k, factors, dst, FP16, centre)
        elif code == BF16:
            _centred_words(src, d, at, body, norms, pow2k, factors, dst, BF16, centre)
        else:
            _centred_words(src, d, at, body, norms, pow2k, factors, dst, FP32, centre)
        return
    # the dtype as a constant: each call compiles the loops of its dtype only (in one function
    # together, LLVM vectorizes them worse)
    if code == FP16:
        _scaled_words(src, d, at, body, norms, pow2k, factors, dst, FP16)
    elif code == BF16:
        _scaled_words(src, d, at, body, norms, pow2k, factors, dst, BF16)
    else:
        _scaled_words(src, d, at, body, norms, pow2k, factors, dst, FP32)


@njit(cache=True, nogil=True)
def _scaled_words(src, d, at, body, norms, pow2k, factors, dst, code):
    """_to_words for dtype `code` (a constant); at = (v0, n, off, m, direct, reach): a vector
    whose norm times reach is under 1 is converted without the clamp."""
    v0, n, off, m, direct, reach = at
    norm_at, norm_stride = norms
    for t in range(n):
        at = t * d + off
        to = (v0 + t) * d if direct else at
        norm = half_to_f32(read_u16(body, norm_at + (v0 + t) * norm_stride))
        clamp = not reach * np.float64(norm) < 1.0
        if code == FP16:
            if clamp:
                for j in range(m):
                    x = src[np.uint64(at + j)] * factors[j] * norm * pow2k
                    dst[np.uint64(to + j)] = fp16_word(x)
            else:
                for j in range(m):
                    x = src[np.uint64(at + j)] * factors[j] * norm * pow2k
                    dst[np.uint64(to + j)] = f32_to_half(x)
        elif code == BF16:
            if clamp:
                for j in range(m):
                    x = src[np.uint64(at + j)] * factors[j] * norm * pow2k
                    dst[np.uint64(to + j)] = bf16_word(x)
            else:
                for j in range(m):
                    x = src[np.uint64(at + j)] * factors[j] * norm * pow2k
                    dst[np.uint64(to + j)] = bf16_round(x)
        else:
            for j in range(m):
                x = src[np.uint64(at + j)] * factors[j] * norm * pow2k
                dst[np.uint64(to + j)] = fp32_word(x)


@njit(cache=True, nogil=True)
def _centred_words(src, d, at, body, norms, pow2k, factors, dst, code, centre):
    """_scaled_words of a centred codec: each value plus its channel's mean (see _to_words)."""
    v0, n, off, m, direct, reach = at
    flat_means, iv, tokens, mean_reach = centre
    norm_at, norm_stride = norms
    outer, in_row = v0 // (iv * tokens), v0 % iv  # counted on, not divided per vector
    token = (v0 // iv) % tokens
    for t in range(n):
        at = t * d + off
        v = v0 + t
        to = v * d if direct else at
        row = (outer * iv + in_row) * d
        in_row += 1
        if in_row == iv:
            in_row = 0
            token += 1
            if token == tokens:
                token = 0
                outer += 1
        norm = half_to_f32(read_u16(body, norm_at + v * norm_stride))
        clamp = not reach * np.float64(norm) + mean_reach < 1.0
        if code == FP16:
            if clamp:
                for j in range(m):
                    x = src[np.uint64(at + j)] * factors[j] * norm * pow2k
                    dst[np.uint64(to + j)] = fp16_word(x + flat_means[np.uint64(row + j)])
            else:
                for j in range(m):
                    x = src[np.uint64(at + j)] * factors[j] * norm * pow2k
                    dst[np.uint64(to + j)] = f32_to_half(x + flat_means[np.uint64(row + j)])
        elif code == BF16:
            if clamp:
                for j in range(m):
                    x = src[np.uint64(at + j)] * factors[j] * norm * pow2k
                    dst[np.uint64(to + j)] = bf16_word(x + flat_means[np.uint64(row + j)])
            else:
                for j in range(m):
                    x = src[np.uint64(at + j)] * factors[j] * norm * pow2k
                    dst[np.uint64(to + j)] = bf16_round(x + flat_means[np.uint64(row + j)])
        else:
            for j in range(m):
                x = src[np.uint64(at + j)] * factors[j] * norm * pow2k
                dst[np.uint64(to + j)] = fp32_word(x + flat_means[np.uint64(row + j)])


_PEAK_MARGIN = 1.01
"""Headroom of _to_words' no-clamp test over _peak's bound, for the float32 rounding of the
butterflies' sums and of the scaling products (each well under 1e-4 relative)."""


@njit(cache=True, nogil=True)
def _peak(inst):
    """A bound of |value| of what _rotate_back leaves for one instance (before _to_words
    scales it): the look-up table's largest level, times 2 for every butterfly stage past the
    table's, times the mix's largest absolute row sum; inf for a dense rotation (not bounded
    here, so always clamped)."""
    m, _, _, matrix, matrix_t, table, _ = inst
    q = max(1, matrix.shape[0])
    if q == m:
        return np.inf
    top = 0.0
    for level in table.reshape(-1):
        top = max(top, abs(np.float64(level)))
    if q == 1:
        return top * (m // table.shape[1])
    row_sum = 0.0
    for a in range(q):
        row_sum = max(row_sum, np.float64(np.abs(matrix_t[a]).sum()))
    return top * row_sum * (m // q)


@njit(cache=True, nogil=True)
def _reach(inst, factors, pow2k, code):
    """What _to_words multiplies a vector's norm by to learn whether it needs the clamp: the
    bound of its values (_peak times the scale and 2**k, with _PEAK_MARGIN) over the dtype's
    largest finite value."""
    scale = abs(np.float64(factors[0])) if factors.size else 0.0
    top = _peak(inst) * scale * np.float64(pow2k) * _PEAK_MARGIN
    return top / max_finite(code)


@njit(cache=True, nogil=True)
def _scale_factors(inst, factors):
    """factors[j]: what _to_words multiplies coordinate j by first: 1 / sqrt(p), negative where
    R's sign j is (1 for a dense rotation, whose matrix holds its signs). Multiplying by the sign
    gives the same bits as flipping the output's sign bit: rounding, the clamp and the
    conversions are symmetric about zero."""
    m, _, signs, matrix, _, _, _ = inst
    dense = matrix.shape[0] == m
    scale = np.float32(1.0) if dense else _block_scale(inst)
    for j in range(m):
        factors[j] = -scale if signs[j] < 0 and not dense else scale


@njit(cache=True, nogil=True)
def _merge_plan(select, hi_m, mixed, word_bytes):
    """How _merge puts a mixed vector's words (hi instance, then lo) in channel order, and _split
    takes them out of it, per selection group g of select = (channels, div, mod): with
    expand_merge / compress_split when this CPU has them for words of word_bytes and d is a
    whole number of their runs of `lanes` words: masks[g, c] the bits of the hi channels of run
    c, starts[g, c] the positions of its first hi and first lo word; otherwise (no runs) word by
    word to channels[g]."""
    channels = select[0]
    n_groups, d = channels.shape
    lanes = EXPAND_LANES // (8 * word_bytes)
    runs = d // lanes if mixed and expands(word_bytes) and d % lanes == 0 else 0
    masks = np.zeros((n_groups, runs), np.uint64)
    starts = np.zeros((n_groups, runs, 2), np.int64)
    counts = np.zeros(max(runs, 1), np.int64)
    for g in range(n_groups if runs else 0):
        counts[:] = 0
        for j in range(hi_m):
            c = channels[g, j]
            masks[g, c // lanes] |= np.uint64(1) << np.uint64(c % lanes)
            counts[c // lanes] += 1
        hi_at, lo_at = 0, hi_m
        for c in range(runs):
            starts[g, c, 0], starts[g, c, 1] = hi_at, lo_at
            hi_at += counts[c]
            lo_at += lanes - counts[c]
    return select, masks, starts


@njit(cache=True, nogil=True, inline="always")
def _next_group(g, in_run, sel_div, sel_mod):
    """The selection group and position in its run of sel_div vectors of the vector after one of
    group g at position in_run (vector v's group is (v // sel_div) % sel_mod): counted, as a
    division per vector would cost more than the channel order it picks."""
    in_run += 1
    if in_run < sel_div:
        return g, in_run
    return (g + 1 if g + 1 < sel_mod else 0), 0


@njit(cache=True, nogil=True)
def _merge(words, d, v0, n, plan, dst):
    """dst[(v0 + t) * d :][:d] = the d words of mixed vector t of a tile at words[t * d :] (its
    hi instance's, then its lo one's) in the channel order of its selection group (see
    _merge_plan and _next_group), t < n."""
    (channels, sel_div, sel_mod), masks, starts = plan
    runs = masks.shape[1]
    g, in_run = (v0 // sel_div) % sel_mod, v0 % sel_div
    for t in range(n):
        at, to = t * d, (v0 + t) * d
        if runs:
            lanes = d // runs
            for c in range(runs):
                hi_at, lo_at = at + starts[g, c, 0], at + starts[g, c, 1]
                expand_merge(words, hi_at, lo_at, masks[g, c], dst, to + c * lanes)
        else:
            for j in range(d):
                dst[np.uint64(to + channels[g, j])] = words[np.uint64(at + j)]
        g, in_run = _next_group(g, in_run, sel_div, sel_mod)


@njit(cache=True, nogil=True)
def _split(x, d, v0, n, plan, rows):
    """The inverse of _merge for the encoder: rows[t] = the d float32 values of mixed vector
    v0 + t, x[t], in the channel order of its selection group (its hi channels, then its lo
    ones), t < n; plan from _merge_plan for 4-byte words."""
    (channels, sel_div, sel_mod), masks, starts = plan
    runs = masks.shape[1]
    src, dst = x.reshape(-1), rows.reshape(-1)
    g, in_run = (v0 // sel_div) % sel_mod, v0 % sel_div
    for t in range(n):
        at = t * d
        if runs:
            lanes = d // runs
            for c in range(runs):
                hi_at, lo_at = at + starts[g, c, 0], at + starts[g, c, 1]
                compress_split(src, at + c * lanes, masks[g, c], dst, hi_at, lo_at)
        else:
            for j in range(d):
                dst[np.uint64(at + j)] = src[np.uint64(at + channels[g, j])]
        g, in_run = _next_group(g, in_run, sel_div, sel_mod)


@njit(cache=True, nogil=True)
def _decode_vectors(body, v0, n, hi, lo, scratch, code, out_words, at, pow2k, centre):
    """Decode vectors v0 .. v0 + n - 1 of a body straight into the output, pass by pass over
    the tile: look up every vector's levels, then per instance rotate them back (butterflies in
    SIMD registers), scale and convert them to output words, and for two instances put each
    vector's words in channel order."""
    y, z, words, scaling, plan = scratch
    hi_scaling, lo_scaling = scaling
    norm_at, norm_stride, index_at, index_stride = at
    hi_m, lo_m = hi[0], lo[0]
    d = hi_m + lo_m
    pairs = y.view(np.uint64)
    _unpack(body, v0, n, hi, index_at, index_stride, pairs, 0, d // 2)
    rotated = _rotate_back(y, d, n, 0, z, hi)
    norms = (norm_at, norm_stride)
    if lo_m == 0:
        _to_words(
            rotated, d, v0, n, 0, hi, body, norms, pow2k, code, hi_scaling, out_words, True, centre
        )
        return
    _to_words(rotated, d, v0, n, 0, hi, body, norms, pow2k, code, hi_scaling, words, False, centre)
    lo_index_at = index_at + packed_bytes(hi_m, hi[1])
    _unpack(body, v0, n, lo, lo_index_at, index_stride, pairs, hi_m // 2, d // 2)
    rotated = _rotate_back(y, d, n, hi_m, z, lo)
    norms = (norm_at + 2, norm_stride)
    _to_words(
        rotated, d, v0, n, hi_m, lo, body, norms, pow2k, code, lo_scaling, words, False, centre
    )
    _merge(words, d, v0, n, plan, out_words)


@njit(cache=True, nogil=True)
def _decode_tiles(body, code, d, select, out_words, offsets, hi, lo, centre, t_lo, t_hi):
    """Decode tiles [t_lo, t_hi) (of _TILE_VALUES // d vectors) of a TurboQuant body
    into `out_words`; see _encode_tiles. centre = (means, iv, tokens): a centred codec's means
    as fp16 bytes (none: a plain codec), and its vector v's row of them, as _to_words says."""
    norms_offset, indices_offset, bpv = offsets
    n_vectors = out_words.size // d
    tile = _TILE_VALUES // d
    n_inst = 2 if lo[0] > 0 else 1
    pow2k = np.float32(pow2(np.int16(read_u16(body, 0))))
    factors = np.empty(d, np.float32)
    hi_factors, lo_factors = factors[: hi[0]], factors[hi[0] :]
    _scale_factors(hi, hi_factors)
    _scale_factors(lo, lo_factors)
    scaling = (
        (hi_factors, _reach(hi, hi_factors, pow2k, code)),
        (lo_factors, _reach(lo, lo_factors, pow2k, code)),
    )
    plan = _merge_plan(select, hi[0], n_inst == 2, out_words.itemsize)
    means_bytes, iv, tokens = centre
    means = np.empty(means_bytes.size // 2, np.float32)
    top = 0.0
    for i in range(means.size):
        means[i] = half_to_f32(read_u16(means_bytes, 2 * i))
        top = max(top, abs(np.float64(means[i])))
    centred = (means, iv, tokens, top * _PEAK_MARGIN / max_finite(code))
    mixes = n_inst == 2 or hi[3].shape[0] > 1
    y = np.empty(tile * d, np.float32)
    z = np.empty(tile * d if mixes else 0, np.float32)
    words = np.empty(tile * d if n_inst == 2 else 0, out_words.dtype)
    scratch = (y, z, words, scaling, plan)
    at = (norms_offset, 2 * n_inst, indices_offset, bpv)
    for v0 in range(t_lo * tile, min(t_hi * tile, n_vectors), tile):
        n = min(tile, n_vectors - v0)
        _decode_vectors(body, v0, n, hi, lo, scratch, code, out_words, at, pow2k, centred)


@njit(cache=True, nogil=True)
def _tile_buffers(d, tile):
    """Scratch space for one encoder tile of `tile` vectors: x and rows (vectors as rows), y and
    z (as columns), indices, norms."""
    return (
        np.empty((tile, d), np.float32),
        np.empty((tile, d), np.float32),
        np.empty((d, tile), np.float32),
        np.empty((d, tile), np.float32),
        np.empty((d, tile), np.int32),
        np.empty(tile, np.float32),
    )


@njit(cache=True, nogil=True)
def _scan_range(words, code, d, sel_div, sel_mod, with_energy, v_lo, v_hi, energy):
    """Largest |x| (as bits) of vectors [v_lo, v_hi); adds their x^2 per selection group and
    channel to energy when with_energy."""
    x = np.empty(d, np.float32)
    max_bits = np.uint32(0)
    for v in range(v_lo, v_hi):
        vector = words[v * d : (v + 1) * d]
        bits = max_abs_bits(vector, code)
        max_bits = max(max_bits, bits)
        if with_energy and bits < nonfinite_bits(code):
            to_f32(vector, code, x)
            row = energy[(v // sel_div) % sel_mod]
            for j in range(d):
                row[j] += np.float64(x[j]) * np.float64(x[j])
    return max_bits


@njit(cache=True, nogil=True)
def scan_serial(words, code, d, sel_div, sel_mod, with_energy):
    """(largest |x| as bits, per selection group and channel sum of x^2 when with_energy)."""
    energy = np.zeros((sel_mod, d), np.float64)
    max_bits = _scan_range(
        words, code, d, sel_div, sel_mod, with_energy, 0, words.size // d, energy
    )
    return max_bits, energy


@njit(parallel=True, nogil=True, cache=True)
def scan_parallel(words, code, d, sel_div, sel_mod, with_energy):
    """scan_serial split across threads."""
    n_vectors = words.size // d
    per_chunk = max(1, _ENERGY_CHUNK_VALUES // d)
    n_chunks = (n_vectors + per_chunk - 1) // per_chunk
    max_bits = np.zeros(max(n_chunks, 1), np.uint32)
    energy = np.zeros((n_chunks, sel_mod, d), np.float64)
    for c in prange(n_chunks):
        lo, hi = c * per_chunk, min(n_vectors, (c + 1) * per_chunk)
        max_bits[c] = _scan_range(words, code, d, sel_div, sel_mod, with_energy, lo, hi, energy[c])
    return max_bits.max(), energy.sum(axis=0)


@njit(cache=True, nogil=True)
def _encode_tiles(words, code, d, select, k, out, offsets, hi, lo, t_lo, t_hi):
    """Encode tiles [t_lo, t_hi) of `words` into `out`.

    select = (channels, div, mod): vector v uses channel order channels[(v // div) % mod];
    offsets = (norms offset, indices offset, bytes per vector); hi / lo = the instance tuples
    of _encode_tile (lo has m = 0 when not mixed)."""
    norms_offset, indices_offset, bpv = offsets
    n_vectors = words.size // d
    n_inst = 2 if lo[0] > 0 else 1
    lo_index_offset = packed_bytes(hi[0], hi[1])
    inv_pow2k = np.float32(pow2(-k))
    tile_vectors = _TILE_VALUES // d
    x, rows, y, z, idx, norms = _tile_buffers(d, tile_vectors)
    scratch = (y, z, idx, norms)
    plan = _merge_plan(select, hi[0], n_inst == 2, 4)
    for tile in range(t_lo, t_hi):
        v0 = tile * tile_vectors
        n = min(tile_vectors, n_vectors - v0)
        flat = x.reshape(-1)[: n * d]
        to_f32(words[v0 * d : (v0 + n) * d], code, flat)
        for i in range(n * d):
            flat[i] *= inv_pow2k
        norm_at = norms_offset + 2 * n_inst * v0
        index_at = indices_offset + bpv * v0
        at = (norm_at, 2 * n_inst, index_at, bpv)
        if n_inst == 1:
            _encode_tile(x, 0, n, hi, scratch, out, at)
            continue
        _split(x, d, v0, n, plan, rows)
        _encode_tile(rows, 0, n, hi, scratch, out, at)
        at = (norm_at + 2, 2 * n_inst, index_at + lo_index_offset, bpv)
        _encode_tile(rows, hi[0], n, lo, scratch, out, at)


@njit(cache=True, nogil=True)
def _n_tiles(n_values, d):
    """Tiles of _TILE_VALUES // d vectors that n_values values of vectors of d fill."""
    return -(-(n_values // d) // (_TILE_VALUES // d))


@njit(cache=True, nogil=True)
def encode_serial(words, code, d, select, k, out, offsets, hi, lo):
    """Encode every vector of `words` into `out` (offsets relative to out[0])."""
    n_tiles = _n_tiles(words.size, d)
    _encode_tiles(words, code, d, select, k, out, offsets, hi, lo, 0, n_tiles)


@njit(parallel=True, nogil=True, cache=True)
def encode_parallel(words, code, d, select, k, out, offsets, hi, lo):
    """encode_serial split across threads."""
    n_tiles = _n_tiles(words.size, d)
    per_chunk = max(1, CHUNK_VALUES // _TILE_VALUES)
    for c in prange((n_tiles + per_chunk - 1) // per_chunk):
        t_lo, t_hi = c * per_chunk, min(n_tiles, (c + 1) * per_chunk)
        _encode_tiles(words, code, d, select, k, out, offsets, hi, lo, t_lo, t_hi)


@njit(cache=True, nogil=True)
def decode_serial(body, code, d, select, out_words, offsets, hi, lo, centre):
    """Decode every vector of a TurboQuant body into `out_words` (`centre`: see _to_words;
    NO_CENTRE for a plain codec)."""
    n_tiles = _n_tiles(out_words.size, d)
    _decode_tiles(body, code, d, select, out_words, offsets, hi, lo, centre, 0, n_tiles)


@njit(parallel=True, nogil=True, cache=True)
def decode_parallel(body, code, d, select, out_words, offsets, hi, lo, centre):
    """decode_serial split across threads."""
    n_tiles = _n_tiles(out_words.size, d)
    per_chunk = max(1, CHUNK_VALUES // _TILE_VALUES)
    for c in prange((n_tiles + per_chunk - 1) // per_chunk):
        t_lo, t_hi = c * per_chunk, min(n_tiles, (c + 1) * per_chunk)
        _decode_tiles(body, code, d, select, out_words, offsets, hi, lo, centre, t_lo, t_hi)


@njit(cache=True, nogil=True)
def decode_rows(run, code, d, select, mask_bytes, rows, out_rows, ok, offsets, hi, lo):
    """Decode the payloads at positions `at` of `run` = (data, stride, head, at) (back to back
    in data, `stride` bytes each, the body after `head` header bytes; sizes already
    validated) into rows `rows` of the words `out_rows`: a run of blocks in one call that keeps
    the GIL released. With `mask_bytes` (mixed
    modes) each body's channel masks are read into select's channels first; ok[i] = False for
    a body whose masks do not select hi[0] channels each (it is not decoded)."""
    data, stride, head, at = run
    channels, _, sel_mod = select
    for i in range(at.size):
        start = at[i] * stride
        body = data[start + head : start + stride]
        if mask_bytes:
            masks = body[2 : 2 + sel_mod * mask_bytes].reshape((sel_mod, mask_bytes))
            if not _mask_channels(masks, hi[0], channels):
                ok[i] = False
                continue
        centre = (np.zeros(0, np.uint8), 1, 1)
        decode_serial(body, code, d, select, out_rows[rows[i]], offsets, hi, lo, centre)


scan_kernel = Threaded(scan_serial, scan_parallel)
encode_kernel = Threaded(encode_serial, encode_parallel)
decode_kernel = Threaded(decode_serial, decode_parallel)


class TurboCodec:
    """TurboQuant with `hi_bits` on every channel, or mixed: d/4 channels at `hi_bits` and the
    rest at `lo_bits`."""

    def __init__(
        self,
        name: str,
        group_size: int,
        hi_bits: int,
        lo_bits: int,
        mixed: bool,
        version: int = FORMAT_VERSION,
    ):
        check_group_size(name, group_size)
        self.name = name
        self.group_size = group_size
        self.version = version
        self.hi = Instance(group_size // 4 if mixed else group_size, hi_bits, version)
        self.lo = Instance(group_size - group_size // 4, lo_bits, version) if mixed else None
        self._kernel_args = (
            self.hi.kernel_args(),
            self.lo.kernel_args() if self.lo else _NO_INSTANCE,
        )
        self._one_order = np.arange(group_size, dtype=np.int32)[None, :]
        self.layout = lru_cache(maxsize=256)(self._layout)

    @classmethod
    def named(cls, name: str, group_size: int = 128, version: int = FORMAT_VERSION) -> TurboCodec:
        """The registered mode `name` (tq4, tq3.5, tq3, tq2.5, tq2) in payload format `version`
        (encoding always writes FORMAT_VERSION)."""
        hi_bits, lo_bits, mixed = TURBO_MODES[name]
        return cls(name, group_size, hi_bits, lo_bits, mixed, version)

    def _layout(self, shape: tuple[int, ...]) -> Layout:
        """The Layout of a block of `shape` (`layout` caches it: decoders ask once per block)."""
        return Layout(self.group_size, self.hi, self.lo, shape)

    def instances(self) -> list[tuple[int, Instance, int]]:
        """(first channel, instance, first packed byte in a vector) for each instance."""
        result = [(0, self.hi, 0)]
        if self.lo is not None:
            result.append((self.hi.m, self.lo, int(packed_bytes(self.hi.m, self.hi.bits))))
        return result

    def kernel_args(self) -> tuple[tuple[object, ...], tuple[object, ...]]:
        """The (hi, lo) instance tuples the kernels take."""
        return self._kernel_args

    def channel_map(self, energy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(channels, masks) for the per-channel energy of each selection group: channels[g] is
        group g's hi channels (its hi.m of most energy, ties to the lower channel), ascending,
        then its lo channels, ascending; masks[g] the packed bit mask of its hi channels, as a
        body stores it (no bytes when not mixed). In Numba, with the GIL released."""
        d = self.group_size
        if self.lo is None:
            return self._one_order, np.zeros((1, 0), np.uint8)
        channels = np.empty(energy.shape, np.int32)
        masks = np.empty((energy.shape[0], (d + 7) // 8), np.uint8)
        _select_channels(energy, self.hi.m, masks, channels)
        return channels, masks

    def encode(self, src: np.ndarray, dtype: str | None = None) -> bytes:
        words, dtype = input_words(src, dtype)
        shape = tuple(src.shape)
        self.check_encodable(words, shape)
        body_bytes = self.layout(shape).body_bytes
        header = pack_header(self.name, dtype, shape, self.group_size, body_bytes)
        payload, body = new_payload(header, body_bytes)
        self.encode_words(words, dtype, shape, body)
        return payload

    def check_encodable(self, words: np.ndarray, shape: tuple[int, ...]) -> None:
        """ValueError unless this codec can encode the flat `words` of a block of `shape`."""
        if self.version != FORMAT_VERSION:
            raise ValueError(f"payloads are written in format version {FORMAT_VERSION} only")
        d = self.group_size
        if words.size % d:
            raise ValueError(
                f"{self.name} encodes whole vectors of group_size={d} values; the block of shape "
                f"{shape} has {words.size} values"
            )

    def encode_words(
        self, words: np.ndarray, dtype: str, shape: tuple[int, ...], body: np.ndarray
    ) -> None:
        """Write the payload body for the flat words of a block of `shape` into `body`."""
        d, code = self.group_size, DTYPE_CODES[dtype]
        layout = self.layout(shape)
        with_energy = self.lo is not None
        max_bits, energy = scan_kernel(
            words.nbytes, words, code, d, layout.sel_div, layout.sel_mod, with_energy
        )
        if max_bits >= nonfinite_bits(code):
            raise NonFiniteError(f"block of shape {shape} holds NaN/Inf")
        k = block_exponent(np.float64(bits_value(np.uint32(max_bits), code)) * math.sqrt(d))
        channels, masks = self.channel_map(energy)
        body[:2] = np.frombuffer(np.int16(k).astype("<i2").tobytes(), np.uint8)
        body[2 : layout.norms_offset] = masks.reshape(-1)
        select = (channels, layout.sel_div, layout.sel_mod)
        encode_kernel(
            words.nbytes, words, code, d, select, k, body, layout.offsets, *self.kernel_args()
        )

    def body_channels(self, body: np.ndarray, layout: Layout) -> np.ndarray:
        """The channel order of each selection row of a payload body (uint8): the channels in
        order for a one-width codec, else the row's high-bit channels (its packed mask) then the
        rest. PayloadError when a mask does not select exactly `hi.m` channels."""
        d = self.group_size
        if self.lo is None:
            return self._one_order
        packed = body[2 : layout.norms_offset].reshape(layout.sel_mod, layout.mask_bytes)
        channels = np.empty((layout.sel_mod, d), np.int32)
        if not _mask_channels(packed, self.hi.m, channels):
            raise PayloadError(
                f"{self.name} payload has a corrupted channel mask (each must select "
                f"{self.hi.m} of {d} channels)"
            )
        return channels

    def decode_words(
        self,
        body: np.ndarray,
        dtype: str,
        shape: tuple[int, ...],
        out_words: np.ndarray,
        centre: tuple[np.ndarray, int, int] = NO_CENTRE,
    ) -> None:
        """Decode a body (length already checked) into the flat words of the output; `centre`:
        the means a centred codec adds (see _to_words)."""
        d = self.group_size
        layout = self.layout(shape)
        select = (self.body_channels(body, layout), layout.sel_div, layout.sel_mod)
        code = DTYPE_CODES[dtype]
        decode_kernel(
            out_words.nbytes,
            body,
            code,
            d,
            select,
            out_words,
            layout.offsets,
            *self.kernel_args(),
            centre,
        )

    def decode_run(
        self,
        run: PayloadRun,
        dtype: str,
        shape: tuple[int, ...],
        out_rows: np.ndarray,
        rows: np.ndarray,
    ) -> np.ndarray:
        """Decode the bodies of `run` (lengths already checked) into rows `rows` of `out_rows`
        ([n, values] words); which were decoded (not those whose channel masks are corrupt)."""
        layout = self.layout(shape)
        channels = self._one_order
        if self.lo is not None:
            channels = np.empty((layout.sel_mod, self.group_size), np.int32)
        ok = np.ones(run.at.size, np.bool_)
        decode_rows(
            (run.data, run.stride, run.head, run.at),
            DTYPE_CODES[dtype],
            self.group_size,
            (channels, layout.sel_div, layout.sel_mod),
            layout.mask_bytes,
            rows,
            out_rows,
            ok,
            layout.offsets,
            *self.kernel_args(),
        )
        return ok


def index_positions(m: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte offset and bit shift of each of m packed indices (the kernels' _pack layout), for the
    torch and MLX decoders."""
    j = np.arange(m)
    return (j // 8) * bits + (j % 8) * bits // 8, (j % 8) * bits % 8


@njit(cache=True, nogil=True)
def _mask_channels(masks, hi_m, channels):
    """channels[g] = the channels set in row g of the packed (LSB-first) bit masks, ascending,
    then the others, ascending; False when a row does not set exactly hi_m of its
    channels.shape[1] bits (bits past them are ignored)."""
    d = channels.shape[1]
    for g in range(channels.shape[0]):
        hi_at, lo_at = 0, hi_m
        for c in range(d):
            if (masks[g, c >> 3] >> (c & 7)) & 1:
                if hi_at == hi_m:
                    return False
                channels[g, hi_at] = c
                hi_at += 1
            else:
                if lo_at == d:
                    return False
                channels[g, lo_at] = c
                lo_at += 1
    return True


@njit(cache=True, nogil=True)
def _select_channels(energy, hi_m, masks, channels):
    """masks[g]: the packed (LSB-first) bit mask of the hi_m channels of row g of energy with
    the most energy, ties to the lower channel (np.argsort(-energy[g], kind="stable")[:hi_m]);
    channels[g]: those channels, ascending, then the others, ascending."""
    masks[:] = 0
    for g in range(energy.shape[0]):
        top = np.argsort(-energy[g], kind="mergesort")[:hi_m]
        for c in top:
            masks[g, c >> 3] |= np.uint8(1 << (c & 7))
    _mask_channels(masks, hi_m, channels)


@lru_cache(maxsize=64)
def named_codec(name: str, group_size: int, version: int = FORMAT_VERSION) -> TurboCodec:
    """The shared TurboCodec for a registered mode, group size and payload format version."""
    return TurboCodec.named(name, group_size, version)


def body_bytes(header: PayloadHeader) -> int:
    """Body length a TurboQuant payload with `header` must have (PayloadError if impossible)."""
    d = header.group_size
    try:
        check_group_size(header.codec, d)
    except ValueError as exc:
        raise PayloadError(f"invalid payload header: {exc}") from None
    if header.size % d:
        raise PayloadError(
            f"invalid {header.codec} payload header: {header.size} values is not a whole number "
            f"of {d}-value vectors"
        )
    return named_codec(header.codec, d).layout(header.shape).body_bytes


def decode_body(header: PayloadHeader, body: np.ndarray, out_words: np.ndarray) -> None:
    """Decode a TurboQuant body (length already validated) into `out_words`."""
    named_codec(header.codec, header.group_size, header.version).decode_words(
        body, header.dtype, header.shape, out_words
    )


def decode_run(
    header: PayloadHeader, run: PayloadRun, out_rows: np.ndarray, rows: np.ndarray
) -> np.ndarray:
    """Decode the payloads of `run` (each with `header`) into rows `rows` of `out_rows`
    ([n, values] words); which were decoded."""
    codec = named_codec(header.codec, header.group_size, header.version)
    return codec.decode_run(run, header.dtype, header.shape, out_rows, rows)


FAMILY = CodecFamily(
    names=tuple(TURBO_MODES),
    make=named_codec,
    body_bytes=lambda header, _: body_bytes(header),
    decode_body=decode_body,
    decode_run=decode_run,
)
"""TurboQuant's modes (tierkv.codecs.TURBO_MODES), for tierkv.quant.codec."""
