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

from tierkv.quant.codebooks import Codebook, Rotation, lloyd_max, rotation
from tierkv.quant.hadamard import fwht, fwht_fits
from tierkv.quant.kernels import (
    BF16,
    CHUNK_VALUES,
    FP16,
    Threaded,
    bf16_word,
    bits_value,
    block_exponent,
    copy_u64_pair,
    f32_to_half,
    fp16_word,
    fp32_word,
    from_f32,
    half_to_f32,
    load_u64,
    max_abs_bits,
    nonfinite_bits,
    pow2,
    read_u16,
    store_le,
    to_f32,
    write_u16,
)
from tierkv.quant.payload import (
    DTYPE_CODES,
    FORMAT_VERSION,
    TURBO_MODES,
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
_TILE = 64
"""Vectors encoded together, laid out as columns so the inner loops run across vectors."""
_DTILE = 32
"""Vectors decoded together, in a tile of rows of _LANES float32: coordinates (2r, 2r + 1) of
vector t sit in row r at lanes 2t and 2t + 1, so every butterfly stage that pairs coordinates
further apart than 1 pairs whole rows (contiguous SIMD lanes), and a table look-up writes a
coordinate pair with one 64-bit move."""
_LANES = 2 * _DTILE


def check_group_size(name: str, group_size: int) -> None:
    """TurboQuant works on vectors of 16..1024 values, a multiple of 8."""
    if not (16 <= group_size <= 1024 and group_size % 8 == 0):
        raise ValueError(
            f"{name} needs group_size (kv_dim) to be a multiple of 8 in [16, 1024], "
            f"got {group_size}"
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


_PAIR_TYPES = {2: np.uint32, 4: np.uint64}
"""Unsigned type of two output words, by word size."""


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
def _radix4(y0, y1, y2, y3, n):
    """Two Walsh-Hadamard butterfly stages on four rows of n lanes (y0 + y1, y0 - y1, the same
    for y2, y3, then across the pairs), in place."""
    for t in range(n):
        s0 = y0[t] + y1[t]
        s1 = y0[t] - y1[t]
        s2 = y2[t] + y3[t]
        s3 = y2[t] - y3[t]
        y0[t] = s0 + s2
        y1[t] = s1 + s3
        y2[t] = s0 - s2
        y3[t] = s1 - s3


@njit(cache=True, nogil=True)
def _fwht_columns(y, m, n):
    """Unnormalised fast Walsh–Hadamard transform of each column y[:m, t], t < n (in place).

    Two butterfly stages per pass over the tile (radix 4), then a last radix-2 stage when
    log2(m) is odd: half the passes of the textbook loop, twice as fast."""
    h = 1
    while 4 * h <= m:
        for i in range(0, m, 4 * h):
            for j in range(i, i + h):
                _radix4(y[j], y[j + h], y[j + 2 * h], y[j + 3 * h], n)
        h *= 4
    if h < m:
        for j in range(h):
            y0, y1 = y[j], y[j + h]
            for t in range(n):
                a = y0[t]
                b = y1[t]
                y0[t] = a + b
                y1[t] = a - b


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
def _dot(a, b, m):
    """sum(a[:m] * b[:m]) in float32 (reassociated, so it vectorizes)."""
    acc = np.float32(0.0)
    for j in range(m):
        acc += a[j] * b[j]
    return acc


@njit(cache=True, nogil=True)
def _pack(idx, m, n, bits, out, start, stride):
    """Bit-pack idx[:m, t] for each vector t into out[start + t * stride:], LSB first, in groups
    of 8 indices (bits bytes each; a last partial group is padded to a byte). Each group is
    assembled for the whole tile at once (across vectors), then stored 4, 2 and 1 bytes at a
    time."""
    groups = np.empty(n, np.uint64)
    for g in range(0, m, 8):
        count = min(8, m - g)
        n_bytes = (count * bits + 7) // 8
        at = start + (g // 8) * bits
        groups[:] = 0
        for i in range(count):
            row, shift = idx[g + i], np.uint64(bits * i)
            for t in range(n):
                groups[t] |= np.uint64(row[t]) << shift
        for t in range(n):
            acc, pos, done = groups[t], at + t * stride, 0
            while n_bytes - done >= 4:
                store_le(out, pos + done, np.uint32(acc >> np.uint64(8 * done)))
                done += 4
            if n_bytes - done >= 2:
                store_le(out, pos + done, np.uint16(acc >> np.uint64(8 * done)))
                done += 2
            if n_bytes > done:
                out[pos + done] = np.uint8(acc >> np.uint64(8 * done))


@njit(cache=True, nogil=True)
def packed_bytes(m, bits):
    """Bytes of m indices at `bits` bits packed by _pack."""
    return (m // 8) * bits + ((m % 8) * bits + 7) // 8


@njit(cache=True, nogil=True, inline="always")
def _count_above(y, m, n, boundaries, count, idx):
    """idx[j, t] = how many of the first `count` boundaries y[j, t] exceeds, for j < m, t < n.
    Inlined with `count` a constant, the loop over boundaries unrolls and the one across
    vectors vectorizes (holding the count in a register instead of in idx)."""
    for j in range(m):
        row, out = y[j], idx[j]
        for t in range(n):
            value = row[t]
            above = np.int32(0)
            for b in range(count):
                above += value > boundaries[b]
            out[t] = above


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
def _encode_tile(x, n, v0, select, offset, inst, scratch, out, at):
    """Norms and packed indices of one instance for vectors v0 .. v0 + n - 1, held in x[:n]
    (already scaled by 2**-k). select = (channels, div, mod) picks each vector's channel order,
    offset the instance's first position in it; inst = (m, bits, signs, matrix, matrix_t,
    centroids, boundaries); scratch = (rows, y, z, idx, norms);
    at = (first norm, norm stride, first index byte, index stride) in out.

    The rotated coordinates land in y[:m, :n], one column per vector, so quantizing and the
    Walsh-Hadamard butterflies run across vectors."""
    channels, sel_div, sel_mod = select
    m, bits, signs, matrix, _, _, boundaries = inst
    rows, y, z, idx, inv_norms = scratch
    norm_at, norm_stride, index_at, index_stride = at
    if m < x.shape[1]:  # mixed: gather this instance's channels
        for t in range(n):  # (unsigned indices into row views: no wraparound, 2-3x faster)
            chan = channels[((v0 + t) // sel_div) % sel_mod, offset : offset + m]
            src, dst = x[t], rows[t]
            for j in range(m):
                dst[j] = src[np.uint32(chan[j])]
        vectors = rows
    else:
        vectors = x
    for t in range(n):
        norm = np.sqrt(_dot(vectors[t], vectors[t], m))
        write_u16(out, norm_at + t * norm_stride, f32_to_half(norm))
        inv_norms[t] = np.float32(1.0) / norm if norm > 0 else np.float32(0.0)
    if matrix.shape[0] < m:  # Hadamard blocks, mixed by matrix when there are several
        q = max(1, matrix.shape[0])
        p = m // q
        scale = np.float32(1.0 / math.sqrt(p))
        for j in range(m):
            f = signs[j] * scale
            for t in range(n):
                y[j, t] = vectors[t, j] * inv_norms[t] * f
        for a in range(q):
            _fwht_columns(y[a * p : (a + 1) * p], p, n)
        if q > 1:
            _mix_columns(y, z, matrix, p)
            y = z
    else:  # a dense m x m matrix (payload format version 1)
        for i in range(m):
            for t in range(n):
                y[i, t] = _dot(matrix[i], vectors[t], m) * inv_norms[t]
    _quantize(y, m, n, boundaries, idx)
    _pack(idx, m, n, bits, out, index_at, index_stride)


@njit(cache=True, nogil=True, inline="always")
def _unpack(body, n, vec, inst, index_at, stride, pairs, pair_step, vector_step):
    """Look up the packed indices of the n vectors of a tile (vector t's at body[index_at +
    vec[t] * stride]) in the instance's table: coordinates (2r, 2r + 1) of vector t become the
    float32 pair pairs[r * pair_step + t * vector_step] (uint64). A table of 4 values per entry
    covers a byte (4 indices of 2 bits: pairs 2i and 2i + 1), one of 2 a pair of indices.
    Inlined, so a caller's constant pair step stays a constant in its stores."""
    m, bits, _, _, _, table, _ = inst
    lanes = table.reshape(-1).view(np.uint64)  # one 64-bit move per pair of coordinates
    # (a view of each vector's bytes: indexing body at a position computed from vec[t] would
    # check every index for negative wraparound)
    if table.shape[1] == 4:
        for t in range(n):
            pos = index_at + vec[t] * stride
            packed = body[pos : pos + m // 4]
            dst = pairs[t * vector_step :]
            for i in range(m // 4):
                code = 2 * np.intp(packed[i])
                if pair_step == 1:  # vector-major: both pairs in one move (12% of a tq2 decode)
                    copy_u64_pair(lanes, code, dst, 2 * i)
                else:
                    dst[(2 * i) * pair_step] = lanes[code]
                    dst[(2 * i + 1) * pair_step] = lanes[code + 1]
    elif bits == 4:
        for t in range(n):
            pos = index_at + vec[t] * stride
            packed = body[pos : pos + m // 2]
            dst = pairs[t * vector_step :]
            for r in range(m // 2):
                dst[r * pair_step] = lanes[packed[r]]
    else:
        pair_bits = np.uint64(2 * bits)
        pair_mask = np.uint64((1 << (2 * bits)) - 1)
        whole = m // 8  # groups of 8 indices: one 64-bit load, 4 look-ups
        for t in range(n):
            pos = index_at + vec[t] * stride
            dst = pairs[t * vector_step :]
            loaded = whole if pos + (whole - 1) * bits + 8 <= body.size else 0
            for k in range(loaded):
                acc = load_u64(body, pos + k * bits)
                at = 4 * k * pair_step
                dst[at] = lanes[acc & pair_mask]
                dst[at + pair_step] = lanes[(acc >> pair_bits) & pair_mask]
                dst[at + 2 * pair_step] = lanes[(acc >> (2 * pair_bits)) & pair_mask]
                dst[at + 3 * pair_step] = lanes[(acc >> (3 * pair_bits)) & pair_mask]
            for g in range(8 * loaded, m, 8):  # the rest byte by byte
                count = min(8, m - g)
                at = pos + (g // 8) * bits
                acc = np.uint64(0)
                for byte in range((count * bits + 7) // 8):
                    acc |= np.uint64(body[at + byte]) << np.uint64(8 * byte)
                for k in range(count // 2):
                    pair = (acc >> (pair_bits * np.uint64(k))) & pair_mask
                    dst[(g // 2 + k) * pair_step] = lanes[pair]


@njit(cache=True, nogil=True)
def _unpack_rows(body, n, vec, inst, index_at, stride, y):
    """_unpack into a tile: coordinates (2r, 2r + 1) of vector t go to row r, lanes 2t and
    2t + 1 of y (see _DTILE)."""
    _unpack(body, n, vec, inst, index_at, stride, y.view(np.uint64), _DTILE, 1)


@njit(cache=True, nogil=True)
def _butterfly_rows(y, r0, rows, h):
    """Butterfly stages of row distance h, 2h, 4h, ... < rows on rows [r0, r0 + rows) of a tile:
    the Walsh-Hadamard stages of coordinate distance 2h and up, two per pass (radix 4). The h
    rows paired with the next h rows are contiguous, so each group is one loop over h rows."""
    while 4 * h <= rows:
        span = h * _LANES
        for i in range(r0 * _LANES, (r0 + rows) * _LANES, 4 * span):
            y0, y1 = y[i : i + span], y[i + span : i + 2 * span]
            _radix4(y0, y1, y[i + 2 * span : i + 3 * span], y[i + 3 * span : i + 4 * span], span)
        h *= 4
    if h < rows:
        span = h * _LANES
        for i in range(r0 * _LANES, (r0 + rows) * _LANES, 2 * span):
            y0, y1 = y[i : i + span], y[i + span : i + 2 * span]
            for lane in range(span):
                s0 = y0[lane] + y1[lane]
                s1 = y0[lane] - y1[lane]
                y0[lane] = s0
                y1[lane] = s1


@njit(cache=True, nogil=True)
def _mix_rows(y, z, mix, p):
    """z = the tile y with its q = mix.shape[0] > 1 blocks of p / 2 rows mixed: block a of z is
    sum_b mix[a, b] * block b of y (summed in order of b from 0), then the first butterfly
    stage (coordinates 2r and 2r + 1, neighbouring lanes) on every row of z, in the pass that
    adds the last block."""
    q = mix.shape[0]
    size = p // 2 * _LANES
    last = y[(q - 1) * size : q * size]
    for a in range(q):
        dst = z[a * size : (a + 1) * size]
        c = mix[a, 0]
        for i in range(size):
            dst[i] = np.float32(0.0) + c * y[i]
        for b in range(1, q - 1):
            c = mix[a, b]
            src = y[b * size : (b + 1) * size]
            for i in range(size):
                dst[i] += c * src[i]
        c = mix[a, q - 1]
        for i in range(size // 2):
            u = dst[2 * i] + c * last[2 * i]
            w = dst[2 * i + 1] + c * last[2 * i + 1]
            dst[2 * i] = u + w
            dst[2 * i + 1] = u - w


@njit(cache=True, nogil=True)
def _rotate_back(y, z, inst):
    """Undo the Hadamard-block rotation of a tile unpacked by _unpack_rows into y, up to the
    factor _block_scale, in y, or in z when blocks are mixed (the array returned); the signs of
    R are left to the caller."""
    m, _, _, matrix, matrix_t, table, _ = inst
    q = max(1, matrix.shape[0])
    p = m // q
    if q > 1:
        _mix_rows(y, z, matrix_t, p)
        y = z
    first = 1 if q > 1 else table.shape[1] // 2  # row distance of the first stage left to do
    for a in range(q):
        _butterfly_rows(y, a * (p // 2), p // 2, first)
    return y


@njit(cache=True, nogil=True)
def _block_scale(inst):
    """The normalisation 1 / sqrt(p) of the instance's Hadamard blocks of p coordinates."""
    m, matrix = inst[0], inst[3]
    return np.float32(1.0 / math.sqrt(m // max(1, matrix.shape[0])))


@njit(cache=True, nogil=True)
def _scaled_words(rotated, m, scale, lane_norms, pow2k, code, words):
    """words = the first m / 2 rows of a tile from _rotate_back, scaled to
    rotated * scale * norm * 2**k (rounded product by product, left to right) and converted to
    dtype `code` in the same pass: 2**k * norm * |R^T levels| per coordinate, the products
    rounded as norm * 2**k * sign * R^T levels was, sign flips being exact."""
    for r in range(m // 2):
        row = rotated[r * _LANES : (r + 1) * _LANES]
        out = words[r * _LANES : (r + 1) * _LANES]
        if code == FP16:
            for lane in range(_LANES):
                out[lane] = fp16_word(row[lane] * scale * lane_norms[lane] * pow2k)
        elif code == BF16:
            for lane in range(_LANES):
                out[lane] = bf16_word(row[lane] * scale * lane_norms[lane] * pow2k)
        else:
            for lane in range(_LANES):
                out[lane] = fp32_word(row[lane] * scale * lane_norms[lane] * pow2k)


@njit(cache=True, nogil=True)
def _read_norms(body, n, vec, norm_at, norm_stride, lane_norms):
    """lane_norms[2t] = lane_norms[2t + 1] = norm of vector t of the tile (at body[norm_at +
    vec[t] * norm_stride]; 0 past n)."""
    for t in range(_DTILE):
        norm = half_to_f32(read_u16(body, norm_at + vec[t] * norm_stride)) if t < n else 0.0
        lane_norms[2 * t] = norm
        lane_norms[2 * t + 1] = norm


@njit(cache=True, nogil=True)
def _sign_masks(signs, word_bits, masks):
    """masks[r]: the sign bits of coordinates 2r and 2r + 1 where signs < 0, placed as in a pair
    of output words."""
    top = np.uint64(word_bits - 1)
    for r in range(signs.size // 2):
        low = np.uint64(1 if signs[2 * r] < 0 else 0) << top
        high = np.uint64(1 if signs[2 * r + 1] < 0 else 0) << (top + np.uint64(word_bits))
        masks[r] = low | high


@njit(cache=True, nogil=True)
def _decode_direct(body, n, vec, inst, scratch, code, out_pairs, at, pow2k):
    """Decode a tile of a one-instance Hadamard body straight into the output: the tile is
    converted to output words in place of the SIMD rows, then moved out pair by pair with R's
    signs applied as sign bits."""
    m = inst[0]
    y, z, lane_norms, words, pairs, masks = scratch[:6]
    norm_at, norm_stride, index_at, index_stride = at
    _unpack_rows(body, n, vec, inst, index_at, index_stride, y)
    _read_norms(body, n, vec, norm_at, norm_stride, lane_norms)
    rotated = _rotate_back(y, z, inst)
    _scaled_words(rotated, m, _block_scale(inst), lane_norms, pow2k, code, words)
    half = m // 2
    for t in range(n):
        dst = out_pairs[vec[t] * half : (vec[t] + 1) * half]
        for r in range(half):
            dst[r] = pairs[r * _DTILE + t] ^ masks[r]


@njit(cache=True, nogil=True)
def _unpack_vectors(body, n, vec, inst, index_at, stride, y):
    """_unpack with vector t's coordinates in order in y[t * m:] (the layout _decode_vectors
    transforms in registers)."""
    _unpack(body, n, vec, inst, index_at, stride, y.view(np.uint64), 1, inst[0] // 2)


@njit(cache=True, nogil=True)
def _decode_vectors(body, n, vec, inst, scratch, code, out_words, at, pow2k):
    """Decode a tile of a one-instance body rotated by a single Hadamard block of a size
    hadamard.fwht is built for, straight into the output: each vector's coordinates in order,
    its butterflies in SIMD registers, then scaled and converted with R's signs as sign bits. No
    tile transposes, and the same operations in the same order as _decode_direct, so the same
    bits."""
    m, _, _, _, _, table, _ = inst
    y, sign_words = scratch[0], scratch[9]
    norm_at, norm_stride, index_at, index_stride = at
    _unpack_vectors(body, n, vec, inst, index_at, index_stride, y)
    for t in range(n):  # (all unpacked first: the vector loads then find the stores done)
        fwht(y, t * m, m, table.shape[1])
    scale = _block_scale(inst)
    for t in range(n):
        norm = half_to_f32(read_u16(body, norm_at + vec[t] * norm_stride))
        row = y[t * m : (t + 1) * m]
        dst = out_words[vec[t] * m : (vec[t] + 1) * m]
        if code == FP16:
            for j in range(m):
                dst[j] = fp16_word(row[j] * scale * norm * pow2k) ^ sign_words[j]
        elif code == BF16:
            for j in range(m):
                dst[j] = bf16_word(row[j] * scale * norm * pow2k) ^ sign_words[j]
        else:
            for j in range(m):
                dst[j] = fp32_word(row[j] * scale * norm * pow2k) ^ sign_words[j]


@njit(cache=True, nogil=True)
def _group_tiles(n_vectors, sel_div, sel_mod):
    """(order, tiles): the vectors sorted by selection group (ascending within one), and per
    tile of up to _DTILE vectors of one group its first entry in `order` and its size; tiles
    go round by round, the k-th of every group then the next (so consecutive tiles read and
    write neighbouring bytes). Vector v's group is (v // sel_div) % sel_mod, counted as v
    goes (two divisions per vector cost about 0.08 ns per value of a mixed-mode decode)."""
    starts = np.zeros(sel_mod + 1, np.int64)
    rounds, rest = divmod(n_vectors, sel_div * sel_mod)
    for g in range(sel_mod):  # whole runs of sel_div vectors, then the last part of one
        starts[g + 1] = rounds * sel_div + min(sel_div, max(0, rest - g * sel_div))
    n_tiles = 0
    for g in range(sel_mod):
        n_tiles += (starts[g + 1] + _DTILE - 1) // _DTILE
        starts[g + 1] += starts[g]
    order = np.empty(n_vectors, np.int64)
    fill = starts[:sel_mod].copy()
    g, in_run = 0, 0
    for v in range(n_vectors):
        order[fill[g]] = v
        fill[g] += 1
        in_run += 1
        if in_run == sel_div:
            in_run = 0
            g = g + 1 if g + 1 < sel_mod else 0
    tiles = np.empty((n_tiles, 2), np.int64)
    i, k = 0, 0
    while i < n_tiles:
        for g in range(sel_mod):
            first = starts[g] + k * _DTILE
            if first < starts[g + 1]:
                tiles[i, 0] = first
                tiles[i, 1] = min(_DTILE, starts[g + 1] - first)
                i += 1
        k += 1
    return order, tiles


@njit(cache=True, nogil=True)
def _pair_sources(chan, m, signs, r0, word_bits, sources, flips):
    """For output channels chan[:m] of one instance (converted to rows r0 .. r0 + m / 2 of a tile
    of output word pairs, see _decode_mixed): sources[c] = 2 * row + the half of the pair holding
    c, and in flips[c // 2] the sign bit of c where R's sign is negative, placed as in a pair of
    output words."""
    top = np.uint64(word_bits - 1)
    for j in range(m):
        c = chan[j]
        sources[c] = 2 * (r0 + j // 2) + j % 2
        if signs[j] < 0:
            flips[c // 2] |= np.uint64(1) << (top + np.uint64(word_bits * (c % 2)))


@njit(cache=True, nogil=True)
def _convert_instance(body, n, vec, inst, scratch, code, at, pow2k, r0):
    """Unpack, rotate back and scale one Hadamard-block instance of a tile, then convert it to
    output words in rows r0 .. r0 + m / 2 of the tile of output words (laid out as the rows)."""
    y, z, lane_norms, words = scratch[:4]
    norm_at, norm_stride, index_at, index_stride = at
    m = inst[0]
    _unpack_rows(body, n, vec, inst, index_at, index_stride, y)
    _read_norms(body, n, vec, norm_at, norm_stride, lane_norms)
    rotated = _rotate_back(y, z, inst)
    _scaled_words(rotated, m, _block_scale(inst), lane_norms, pow2k, code, words[r0 * _LANES :])


@njit(cache=True, nogil=True)
def _decode_mixed(body, n, vec, g, hi, lo, scratch, code, out_pairs, at, pow2k):
    """Decode a tile of vectors vec[:n] of one selection group g of a two-instance
    Hadamard-block body straight into the output. Both instances are converted to output words
    in their rows of one tile; as every vector of the tile has the same channel order, putting
    the channels in order is a fixed choice of word per pair row, the same across the tile's
    SIMD lanes (with R's signs as sign bits); the tile is then moved out pair by pair."""
    words, pairs = scratch[3], scratch[4]
    sources, flips, ordered = scratch[6], scratch[7], scratch[8]
    norm_at, norm_stride, index_at, index_stride = at
    _convert_instance(body, n, vec, hi, scratch, code, at, pow2k, 0)
    lo_at = (norm_at + 2, norm_stride, index_at + packed_bytes(hi[0], hi[1]), index_stride)
    _convert_instance(body, n, vec, lo, scratch, code, lo_at, pow2k, hi[0] // 2)
    word_bits = 8 * words.itemsize
    low = (np.uint64(1) << np.uint64(word_bits)) - np.uint64(1)
    half = (hi[0] + lo[0]) // 2
    for r in range(half):
        even, odd = sources[g, 2 * r], sources[g, 2 * r + 1]
        a = pairs[(even >> 1) * _DTILE : ((even >> 1) + 1) * _DTILE]
        b = pairs[(odd >> 1) * _DTILE : ((odd >> 1) + 1) * _DTILE]
        a_shift = pairs.dtype.type(word_bits * (even & 1))
        b_shift = pairs.dtype.type(word_bits * (odd & 1))
        up = pairs.dtype.type(word_bits)
        mask = pairs.dtype.type(low)
        flip = pairs.dtype.type(flips[g, r])
        dst = ordered[r * _DTILE : (r + 1) * _DTILE]
        for t in range(_DTILE):
            dst[t] = (((a[t] >> a_shift) & mask) | ((b[t] >> b_shift) << up)) ^ flip
    for t in range(n):
        dst = out_pairs[vec[t] * half : (vec[t] + 1) * half]
        for r in range(half):
            dst[r] = ordered[r * _DTILE + t]


@njit(cache=True, nogil=True)
def _decode_into_rows(body, n, vec, select, offset, inst, scratch, x, at, pow2k):
    """x[t, channels] = 2**k * norm * R^T levels for one instance of vectors vec[:n]
    (select and offset as in _encode_tile); scratch = (y, z, lane_norms, rows)."""
    channels, sel_div, sel_mod = select
    m, _, signs, matrix, matrix_t, _, _ = inst
    y, z, lane_norms, rows = scratch
    norm_at, norm_stride, index_at, index_stride = at
    _unpack_rows(body, n, vec, inst, index_at, index_stride, y)
    if matrix.shape[0] < m:  # Hadamard blocks, mixed by matrix when there are several
        _read_norms(body, n, vec, norm_at, norm_stride, lane_norms)
        rotated = _rotate_back(y, z, inst)
        scale = _block_scale(inst)
        for t in range(n):
            chan = channels[(vec[t] // sel_div) % sel_mod][offset : offset + m]
            row = x[t]
            norm = lane_norms[2 * t]
            for r in range(m // 2):
                at = r * _LANES + 2 * t
                row[chan[2 * r]] = rotated[at] * scale * norm * pow2k * signs[2 * r]
                row[chan[2 * r + 1]] = rotated[at + 1] * scale * norm * pow2k * signs[2 * r + 1]
    else:  # a dense m x m matrix (payload format version 1)
        for t in range(n):
            norm = half_to_f32(read_u16(body, norm_at + vec[t] * norm_stride))
            for j in range(m):
                rows[t, j] = y[(j // 2) * _LANES + 2 * t + j % 2]
            chan = channels[(vec[t] // sel_div) % sel_mod]
            for i in range(m):
                x[t, chan[offset + i]] = _dot(matrix_t[i], rows[t], m) * norm * pow2k


@njit(cache=True, nogil=True)
def _tile_buffers(d):
    """Scratch space for one encoder tile: x and rows (vectors as rows), y and z (as columns),
    indices, norms."""
    return (
        np.empty((_TILE, d), np.float32),
        np.empty((_TILE, d), np.float32),
        np.empty((d, _TILE), np.float32),
        np.empty((d, _TILE), np.float32),
        np.empty((d, _TILE), np.int32),
        np.empty(_TILE, np.float32),
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
    x, rows, y, z, idx, norms = _tile_buffers(d)
    scratch = (rows, y, z, idx, norms)
    for tile in range(t_lo, t_hi):
        v0 = tile * _TILE
        n = min(_TILE, n_vectors - v0)
        flat = x.reshape(-1)[: n * d]
        to_f32(words[v0 * d : (v0 + n) * d], code, flat)
        for i in range(n * d):
            flat[i] *= inv_pow2k
        norm_at = norms_offset + 2 * n_inst * v0
        index_at = indices_offset + bpv * v0
        at = (norm_at, 2 * n_inst, index_at, bpv)
        _encode_tile(x, n, v0, select, 0, hi, scratch, out, at)
        if n_inst == 2:
            at = (norm_at + 2, 2 * n_inst, index_at + lo_index_offset, bpv)
            _encode_tile(x, n, v0, select, hi[0], lo, scratch, out, at)


@njit(cache=True, nogil=True)
def _is_mixed_hadamard(hi, lo):
    """Whether both instances exist and rotate by Hadamard blocks (payload format 2 mixed)."""
    return lo[0] > 0 and hi[3].shape[0] < hi[0] and lo[3].shape[0] < lo[0]


@njit(cache=True, nogil=True)
def _decode_plan(n_vectors, select, hi, lo):
    """_group_tiles of the decoder: tiles of one selection group when _decode_mixed decodes
    them, else of consecutive vectors."""
    _, sel_div, sel_mod = select
    if _is_mixed_hadamard(hi, lo):
        return _group_tiles(n_vectors, sel_div, sel_mod)
    return _group_tiles(n_vectors, 1, 1)


@njit(cache=True, nogil=True)
def _decode_tiles(body, code, d, select, out_words, out_pairs, offsets, hi, lo, plan, t_lo, t_hi):
    """Decode tiles [t_lo, t_hi) of `plan` (_decode_plan) of a TurboQuant body into `out_words`
    (`out_pairs` is the same memory as words of twice the size); see _encode_tiles."""
    norms_offset, indices_offset, bpv = offsets
    order, tiles = plan
    n_inst = 2 if lo[0] > 0 else 1
    lo_index_offset = packed_bytes(hi[0], hi[1])
    pow2k = np.float32(pow2(np.int16(read_u16(body, 0))))
    y = np.zeros(d // 2 * _LANES, np.float32)
    z = np.empty(d // 2 * _LANES, np.float32)
    lane_norms = np.empty(_LANES, np.float32)
    direct = n_inst == 1 and hi[3].shape[0] < d
    vectors = direct and hi[3].shape[0] <= 1 and fwht_fits(d, hi[5].shape[1])
    mixed = _is_mixed_hadamard(hi, lo)
    pairs = np.empty(d * _DTILE // 2, out_pairs.dtype)
    masks = np.zeros(d // 2, out_pairs.dtype)
    if direct:
        _sign_masks(hi[2], 8 * out_words.itemsize, masks)
    sign_words = masks.view(out_words.dtype)
    channels, sel_div, sel_mod = select
    sources = np.zeros((channels.shape[0], d), np.int64)
    flips = np.zeros((channels.shape[0], d // 2), out_pairs.dtype)
    if mixed:
        for g in range(channels.shape[0]):
            word_bits = 8 * out_words.itemsize
            _pair_sources(channels[g], hi[0], hi[2], 0, word_bits, sources[g], flips[g])
            chan = channels[g][hi[0] :]
            _pair_sources(chan, lo[0], lo[2], hi[0] // 2, word_bits, sources[g], flips[g])
    ordered = z.view(out_pairs.dtype)[: pairs.size]  # z is free once a tile is converted
    words = pairs.view(out_words.dtype)
    scratch = (y, z, lane_norms, words, pairs, masks, sources, flips, ordered, sign_words)
    x = np.empty((_DTILE, d), np.float32)
    rows_scratch = (y, z, lane_norms, np.empty((_DTILE, d), np.float32))
    at = (norms_offset, 2 * n_inst, indices_offset, bpv)
    lo_at = (norms_offset + 2, 2 * n_inst, indices_offset + lo_index_offset, bpv)
    for tile in range(t_lo, t_hi):
        first, n = tiles[tile, 0], tiles[tile, 1]
        vec = order[first : first + n]
        if vectors:
            _decode_vectors(body, n, vec, hi, scratch, code, out_words, at, pow2k)
        elif direct:
            _decode_direct(body, n, vec, hi, scratch, code, out_pairs, at, pow2k)
        elif mixed:
            g = (vec[0] // sel_div) % sel_mod
            _decode_mixed(body, n, vec, g, hi, lo, scratch, code, out_pairs, at, pow2k)
        else:
            _decode_into_rows(body, n, vec, select, 0, hi, rows_scratch, x, at, pow2k)
            if n_inst == 2:
                _decode_into_rows(body, n, vec, select, hi[0], lo, rows_scratch, x, lo_at, pow2k)
            v0 = vec[0]
            from_f32(x.reshape(-1)[: n * d], code, out_words[v0 * d : (v0 + n) * d])


@njit(cache=True, nogil=True)
def encode_serial(words, code, d, select, k, out, offsets, hi, lo):
    """Encode every vector of `words` into `out` (offsets relative to out[0])."""
    n_tiles = (words.size // d + _TILE - 1) // _TILE
    _encode_tiles(words, code, d, select, k, out, offsets, hi, lo, 0, n_tiles)


@njit(parallel=True, nogil=True, cache=True)
def encode_parallel(words, code, d, select, k, out, offsets, hi, lo):
    """encode_serial split across threads."""
    n_tiles = (words.size // d + _TILE - 1) // _TILE
    per_chunk = max(1, CHUNK_VALUES // (_TILE * d))
    for c in prange((n_tiles + per_chunk - 1) // per_chunk):
        t_lo, t_hi = c * per_chunk, min(n_tiles, (c + 1) * per_chunk)
        _encode_tiles(words, code, d, select, k, out, offsets, hi, lo, t_lo, t_hi)


@njit(cache=True, nogil=True)
def decode_serial(body, code, d, select, out_words, out_pairs, offsets, hi, lo):
    """Decode every vector of a TurboQuant body into `out_words` (`out_pairs`: the same memory
    as words of twice the size)."""
    plan = _decode_plan(out_words.size // d, select, hi, lo)
    n_tiles = plan[1].shape[0]
    _decode_tiles(body, code, d, select, out_words, out_pairs, offsets, hi, lo, plan, 0, n_tiles)


@njit(parallel=True, nogil=True, cache=True)
def decode_parallel(body, code, d, select, out_words, out_pairs, offsets, hi, lo):
    """decode_serial split across threads."""
    plan = _decode_plan(out_words.size // d, select, hi, lo)
    n_tiles = plan[1].shape[0]
    per_chunk = max(1, CHUNK_VALUES // (_DTILE * d))
    for c in prange((n_tiles + per_chunk - 1) // per_chunk):
        t_lo, t_hi = c * per_chunk, min(n_tiles, (c + 1) * per_chunk)
        _decode_tiles(
            body, code, d, select, out_words, out_pairs, offsets, hi, lo, plan, t_lo, t_hi
        )


@njit(cache=True, nogil=True)
def decode_rows(run, code, d, select, mask_bytes, rows, out, ok, offsets, hi, lo):
    """Decode the payloads at positions `at` of `run` = (data, stride, head, at) (back to back
    in data, `stride` bytes each, the body after `head` header bytes; sizes already
    validated) into rows `rows` of `out` = (row words, the same memory as words of twice the
    size): a run of blocks in one call that keeps the GIL released. With `mask_bytes` (mixed
    modes) each body's channel masks are read into select's channels first; ok[i] = False for
    a body whose masks do not select hi[0] channels each (it is not decoded)."""
    data, stride, head, at = run
    channels, _, sel_mod = select
    out_rows, pair_rows = out
    for i in range(at.size):
        start = at[i] * stride
        body = data[start + head : start + stride]
        if mask_bytes:
            masks = body[2 : 2 + sel_mod * mask_bytes].reshape((sel_mod, mask_bytes))
            if not _mask_channels(masks, hi[0], channels):
                ok[i] = False
                continue
        out_words, out_pairs = out_rows[rows[i]], pair_rows[rows[i]]
        decode_serial(body, code, d, select, out_words, out_pairs, offsets, hi, lo)


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
        self, body: np.ndarray, dtype: str, shape: tuple[int, ...], out_words: np.ndarray
    ) -> None:
        """Decode a body (length already checked) into the flat words of the output."""
        d = self.group_size
        layout = self.layout(shape)
        select = (self.body_channels(body, layout), layout.sel_div, layout.sel_mod)
        code = DTYPE_CODES[dtype]
        out_pairs = out_words.view(_PAIR_TYPES[out_words.itemsize])
        decode_kernel(
            out_words.nbytes,
            body,
            code,
            d,
            select,
            out_words,
            out_pairs,
            layout.offsets,
            *self.kernel_args(),
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
            (out_rows, out_rows.view(_PAIR_TYPES[out_rows.itemsize])),
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
