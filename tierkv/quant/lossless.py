"""The `none` codec: the block's own bytes behind a header (bit-exact), checked finite as they are
copied into the payload (one pass: each word is checked as it is copied).

Decoding is one copy of the body into the output. A block-sized copy with ordinary stores runs
at about 0.55x a whole-array memcpy: each destination cache line is first read (the store
misses, the core fetches the line to own it), so three bytes cross the memory bus per byte
copied, where glibc's memcpy of a large array uses non-temporal stores (two). np.copyto and
memmove only switch to those above a few MB, so decode_body streams blocks of STREAM_MIN_BYTES
or more with 64-byte non-temporal stores (then a fence).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from tierkv.codecs import DTYPE_BYTES, DTYPE_CODES
from tierkv.quant.base import CodecFamily
from tierkv.quant.kernels import CHUNK_VALUES, FP32, Threaded, max_abs_bits, nonfinite_bits
from tierkv.quant.payload import (
    NonFiniteError,
    PayloadHeader,
    input_words,
    new_payload,
    pack_header,
)


@njit(cache=True, nogil=True)
def _copy_max_abs_bits(words, code, out_words):
    """out_words[:] = words, returning max_abs_bits(words, code) of the same pass (each word is
    stored and folded into the maximum as it is read, so the copy costs one read of the input;
    the explicit casts keep the reduction at the word width, so it vectorizes)."""
    if code == FP32:
        m32 = np.uint32(0)
        for i in range(words.size):
            w32 = np.uint32(words[i])
            out_words[i] = w32
            m32 = np.uint32(max(m32, np.uint32(w32 & np.uint32(0x7FFFFFFF))))
        return m32
    m16 = np.uint16(0)
    for i in range(words.size):
        w16 = np.uint16(words[i])
        out_words[i] = w16
        m16 = np.uint16(max(m16, np.uint16(w16 & np.uint16(0x7FFF))))
    return np.uint32(m16)


@njit(cache=True, nogil=True)
def _copy_chunks(words, code, out_words, c_lo, c_hi):
    """Copy chunks [c_lo, c_hi) of `words` (dtype `code`) to `out_words`; returns how many hold
    a NaN or Inf."""
    bad = 0
    for c in range(c_lo, c_hi):
        at = c * CHUNK_VALUES
        chunk = words[at : at + CHUNK_VALUES]
        bits = _copy_max_abs_bits(chunk, code, out_words[at : at + chunk.size])
        bad += bits >= nonfinite_bits(code)
    return bad


@njit(cache=True, nogil=True)
def copy_checked_serial(words, code, out_words):
    """out_words[:] = words; returns the number of chunks holding a NaN or Inf."""
    return _copy_chunks(words, code, out_words, 0, (words.size + CHUNK_VALUES - 1) // CHUNK_VALUES)


@njit(parallel=True, nogil=True, cache=True)
def copy_checked_parallel(words, code, out_words):
    """copy_checked_serial split across threads."""
    bad = 0
    for c in prange((words.size + CHUNK_VALUES - 1) // CHUNK_VALUES):
        bad += _copy_chunks(words, code, out_words, c, c + 1)
    return bad


copy_checked = Threaded(copy_checked_serial, copy_checked_parallel)

STREAM_MIN_BYTES = 32 << 10
"""Bodies at least this large are decoded with non-temporal stores (measured faster from 32 KB
blocks up, single-threaded); smaller ones with ordinary stores, which leave them in cache."""
_LINE = 64


@intrinsic
def _stream_line(typingctx, dst, at, src, src_at):
    """Copy the 64 bytes of uint8 array `src` at `src_at` (any alignment) to uint8 array `dst` at
    `at` (64-byte aligned) with one non-temporal store, bypassing the cache."""
    sig = types.void(dst, at, src, src_at)

    def codegen(context, builder, signature, args):
        line = ir.VectorType(ir.IntType(64), _LINE // 8).as_pointer()
        out = context.make_array(signature.args[0])(context, builder, args[0])
        inp = context.make_array(signature.args[2])(context, builder, args[2])
        value = builder.load(builder.bitcast(builder.gep(inp.data, [args[3]]), line), align=1)
        store = builder.store(value, builder.bitcast(builder.gep(out.data, [args[1]]), line), _LINE)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_fence(typingctx):
    """A full fence: the non-temporal stores before it are visible to every core after it."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@njit(cache=True, nogil=True)
def stream_copy(src, dst):
    """dst[:] = src (uint8 arrays of one size); from STREAM_MIN_BYTES on, with non-temporal
    stores for the 64-byte aligned middle."""
    n = dst.size
    if n < STREAM_MIN_BYTES:
        dst[:] = src
        return
    head = min(n, (-dst.ctypes.data) % _LINE)
    dst[:head] = src[:head]
    at = head
    while at + _LINE <= n:
        _stream_line(dst, at, src, at)
        at += _LINE
    dst[at:] = src[at:]
    _store_fence()


class LosslessCodec:
    """Stores the block bit-exact (payload = header + raw little-endian words)."""

    name = "none"

    def __init__(self, group_size: int = 128) -> None:
        if not 1 <= group_size <= 1 << 20:  # unused here, but recorded in the header
            raise ValueError(f"none group_size must be in [1, 2**20], got {group_size}")
        self.group_size = group_size

    def encode(self, src: np.ndarray, dtype: str | None = None) -> bytes:
        words, dtype = input_words(src, dtype)
        header = pack_header(self.name, dtype, tuple(src.shape), self.group_size, words.nbytes)
        payload, body = new_payload(header, words.nbytes)
        if copy_checked(words.nbytes, words, DTYPE_CODES[dtype], body.view(words.dtype)):
            raise NonFiniteError(f"block of {words.size} values holds NaN/Inf")
        return payload

    def encode_pieces(self, src: np.ndarray, dtype: str | None = None) -> tuple[bytes, memoryview]:
        """The payload `encode` makes, in two pieces and without a copy: the header, and a
        read-only byte view of `src`'s own memory (of a contiguous copy when `src` is not
        C-contiguous). The caller must not change `src` while the view is in use."""
        words, dtype = input_words(src, dtype)
        code = DTYPE_CODES[dtype]
        if max_abs_bits(words, code) >= nonfinite_bits(code):
            raise NonFiniteError(f"block of {words.size} values holds NaN/Inf")
        header = pack_header(self.name, dtype, tuple(src.shape), self.group_size, words.nbytes)
        return header, words.view(np.uint8).data


def body_bytes(header: PayloadHeader, body: memoryview) -> int:
    """The body length a lossless payload with `header` must have: its raw words."""
    return header.size * DTYPE_BYTES[header.dtype]


def decode_body(header: PayloadHeader, body: np.ndarray, out_words: np.ndarray) -> None:
    """Copy the raw words of `body` into `out_words` (sizes already checked)."""
    stream_copy(body, out_words.view(np.uint8))


FAMILY = CodecFamily(
    names=("none",),
    make=lambda _, group_size: LosslessCodec(group_size),
    body_bytes=body_bytes,
    decode_body=decode_body,
)
"""The lossless codec, for tierkv.quant.codec."""
