"""INT8 codec: symmetric absmax quantization per group of `group_size` contiguous values.

Body: block exponent k (int16) | one fp16 scale per group | one int8 per value.
A group's step is scale * 2**k. The block exponent exists because fp16 alone is not enough for a
scale: bf16 and fp32 blocks can need scales above 65504, and small groups of fp16 values need
scales below fp16's normal range (6.1e-5, i.e. absmax < 0.0078) where fp16 loses precision. k is
chosen so the largest scale of the block lands in [2**14, 2**15); every scale within 2**28 of it
keeps full fp16 precision. Scales are rounded toward zero so that |decoded| <= absmax (no Inf).
The last group may be shorter than `group_size` (any element count round-trips).

Per value: q = round_half_even(clamp(x / step, -127, 127)); decoded = q * step rounded to the
output type. Every step is IEEE float32 arithmetic, so torch_ops reproduces it bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tierkv.codecs import DTYPE_CODES
from tierkv.quant.base import CodecFamily
from tierkv.quant.kernels import (
    CHUNK_VALUES,
    Threaded,
    bits_value,
    block_exponent,
    f32_to_half,
    from_f32,
    half_to_f32,
    max_abs_bits,
    nonfinite_bits,
    pow2,
    read_u16,
    write_u16,
)
from tierkv.quant.payload import (
    NonFiniteError,
    PayloadHeader,
    PayloadRun,
    input_words,
    new_payload,
    pack_header,
)

_ROUND_MAGIC = np.float32(12582912.0)
"""1.5 * 2**23: (x + M) - M rounds x half to even for |x| < 2**22."""
_QMAX = np.float32(127.0)


def body_bytes(n: int, group_size: int) -> int:
    """Body length for `n` values in groups of `group_size`."""
    return 2 + 2 * -(-n // group_size) + n


@njit(cache=True, nogil=True)
def scale_to_half(scale, inv_pow2k):
    """fp16 bits of scale * 2**-k, rounded toward zero (so the step never exceeds the scale)."""
    scaled = np.float32(np.float64(scale) * inv_pow2k)
    h = f32_to_half(scaled)
    if half_to_f32(h) > scaled:
        h -= np.uint16(1)
    return h


@njit(cache=True, nogil=True)
def step_of(h, pow2k):
    """The float32 quantization step of a group whose stored scale is fp16 bits `h`."""
    return np.float32(np.float64(half_to_f32(h)) * pow2k)


@njit(cache=True, nogil=True)
def _scale_groups(words, code, group_size, scales, g_lo, g_hi):
    """scales[g] = absmax / 127 for groups [g_lo, g_hi); returns how many hold NaN/Inf."""
    nonfinite = 0
    for g in range(g_lo, g_hi):
        bits = max_abs_bits(words[g * group_size : (g + 1) * group_size], code)
        nonfinite += bits >= nonfinite_bits(code)
        scales[g] = bits_value(bits, code) / _QMAX
    return nonfinite


@njit(cache=True, nogil=True)
def _quantize(x, step):
    """round_half_even(clamp(x / step, -127, 127)) as an int8 byte."""
    v = min(max(x / step, -_QMAX), _QMAX)
    return np.uint8(np.int8((v + _ROUND_MAGIC) - _ROUND_MAGIC))


_RUN = 32
"""Values quantized per inner loop of a fixed length, which LLVM unrolls into whole SIMD vectors
with no per-group loop set-up (groups are often 128 values: four such runs)."""


@njit(cache=True, nogil=True)
def _quantize_groups(words, code, group_size, scales, k, out, g_lo, g_hi):
    """Write the fp16 scales and int8 values of groups [g_lo, g_hi) into the body `out`."""
    n, n_groups = words.size, scales.size
    pow2k, inv_pow2k = pow2(k), pow2(-k)
    q_base = 2 + 2 * n_groups
    values = out[q_base : q_base + n]
    for g in range(g_lo, g_hi):
        h = scale_to_half(scales[g], inv_pow2k)
        write_u16(out, 2 + 2 * g, h)
        step = step_of(h, pow2k)
        at, end = g * group_size, min((g + 1) * group_size, n)
        if step <= np.float32(0.0):
            values[at:end] = 0
            continue
        while at + _RUN <= end:
            run, q = words[at : at + _RUN], values[at : at + _RUN]
            for i in range(_RUN):
                q[i] = _quantize(bits_value(np.uint32(run[i]), code), step)
            at += _RUN
        for i in range(at, end):
            values[i] = _quantize(bits_value(np.uint32(words[i]), code), step)


@njit(cache=True, nogil=True)
def _dequantize_groups(body, code, group_size, out_words, g_lo, g_hi):
    """Decode groups [g_lo, g_hi) of an int8 body into `out_words`."""
    n = out_words.size
    pow2k = pow2(np.int16(read_u16(body, 0)))
    q_base = 2 + 2 * ((n + group_size - 1) // group_size)
    values = body[q_base : q_base + n].view(np.int8)
    buf = np.empty(group_size, np.float32)
    for g in range(g_lo, g_hi):
        step = step_of(read_u16(body, 2 + 2 * g), pow2k)
        q = values[g * group_size : (g + 1) * group_size]
        for i in range(q.size):
            buf[i] = np.float32(q[i]) * step
        from_f32(buf[: q.size], code, out_words[g * group_size : (g + 1) * group_size])


@njit(cache=True, nogil=True)
def _write_exponent(scales, out):
    """Choose the block exponent from the largest scale and store it; returns it."""
    k = block_exponent(scales.max()) if scales.size else 0
    write_u16(out, 0, np.uint16(np.int16(k)))
    return k


@njit(cache=True, nogil=True)
def encode_serial(words, code, group_size, out):
    """Quantize `words` into the body `out`; returns how many groups hold NaN/Inf (0 = ok)."""
    n_groups = (words.size + group_size - 1) // group_size
    scales = np.empty(n_groups, np.float32)
    bad = _scale_groups(words, code, group_size, scales, 0, n_groups)
    if bad:
        return bad
    k = _write_exponent(scales, out)
    _quantize_groups(words, code, group_size, scales, k, out, 0, n_groups)
    return 0


@njit(parallel=True, nogil=True, cache=True)
def encode_parallel(words, code, group_size, out):
    """encode_serial split across threads."""
    n_groups = (words.size + group_size - 1) // group_size
    per_chunk = max(1, CHUNK_VALUES // group_size)
    n_chunks = (n_groups + per_chunk - 1) // per_chunk
    scales = np.empty(n_groups, np.float32)
    bad = 0
    for c in prange(n_chunks):
        lo, hi = c * per_chunk, min(n_groups, (c + 1) * per_chunk)
        bad += _scale_groups(words, code, group_size, scales, lo, hi)
    if bad:
        return bad
    k = _write_exponent(scales, out)
    for c in prange(n_chunks):
        lo, hi = c * per_chunk, min(n_groups, (c + 1) * per_chunk)
        _quantize_groups(words, code, group_size, scales, k, out, lo, hi)
    return 0


@njit(cache=True, nogil=True)
def decode_serial(body, code, group_size, out_words):
    """Dequantize an int8 body into `out_words` (sizes already validated)."""
    n_groups = (out_words.size + group_size - 1) // group_size
    _dequantize_groups(body, code, group_size, out_words, 0, n_groups)


@njit(parallel=True, nogil=True, cache=True)
def decode_parallel(body, code, group_size, out_words):
    """decode_serial split across threads."""
    n_groups = (out_words.size + group_size - 1) // group_size
    per_chunk = max(1, CHUNK_VALUES // group_size)
    n_chunks = (n_groups + per_chunk - 1) // per_chunk
    for c in prange(n_chunks):
        lo, hi = c * per_chunk, min(n_groups, (c + 1) * per_chunk)
        _dequantize_groups(body, code, group_size, out_words, lo, hi)


@njit(cache=True, nogil=True)
def decode_rows(run, code, group_size, out_rows, rows):
    """Decode the payloads at positions `at` of `run` = (data, stride, head, at) (back to back
    in data, `stride` bytes each, the body after `head` header bytes; sizes already
    validated) into rows `rows` of `out_rows`: a run of blocks in one call that keeps the GIL
    released."""
    data, stride, head, at = run
    for i in range(at.size):
        start = at[i] * stride
        body = data[start + head : start + stride]
        decode_serial(body, code, group_size, out_rows[rows[i]])


encode_kernel = Threaded(encode_serial, encode_parallel)
decode_kernel = Threaded(decode_serial, decode_parallel)


class Int8Codec:
    """Symmetric absmax INT8, one fp16 scale per group of `group_size` values (≈1.97x vs fp16)."""

    name = "int8"

    def __init__(self, group_size: int = 128) -> None:
        if not 1 <= group_size <= 1 << 20:
            raise ValueError(f"int8 group_size must be in [1, 2**20], got {group_size}")
        self.group_size = group_size

    def encode(self, src: np.ndarray, dtype: str | None = None) -> bytes:
        words, dtype = input_words(src, dtype)
        shape = tuple(src.shape)
        body_len = body_bytes(words.size, self.group_size)
        header = pack_header(self.name, dtype, shape, self.group_size, body_len)
        payload, body = new_payload(header, body_len)
        code = DTYPE_CODES[dtype]
        bad = encode_kernel(words.nbytes, words, code, self.group_size, body)
        if bad:
            raise NonFiniteError(f"block holds NaN/Inf in {bad} of its groups of {self.group_size}")
        return payload


def decode_body(header: PayloadHeader, body: np.ndarray, out_words: np.ndarray) -> None:
    """Decode an int8 body (length already validated) into `out_words`."""
    code = DTYPE_CODES[header.dtype]
    decode_kernel(out_words.nbytes, body, code, header.group_size, out_words)


def decode_run(
    header: PayloadHeader, run: PayloadRun, out_rows: np.ndarray, rows: np.ndarray
) -> np.ndarray:
    """Decode the payloads of `run` (each with `header`) into rows `rows` of `out_rows`
    ([n, values] words); which were decoded (all of them)."""
    code = DTYPE_CODES[header.dtype]
    decode_rows((run.data, run.stride, run.head, run.at), code, header.group_size, out_rows, rows)
    return np.ones(run.at.size, np.bool_)


FAMILY = CodecFamily(
    names=("int8",),
    make=lambda _, group_size: Int8Codec(group_size),
    body_bytes=lambda header, _: body_bytes(header.size, header.group_size),
    decode_body=decode_body,
    decode_run=decode_run,
)
"""INT8, for tierkv.quant.codec."""
