"""Numba building blocks shared by every codec kernel: reading and writing fp16 / bf16 / fp32 words.

Inputs reach the kernels as raw words (uint16 for fp16 and bf16, uint32 for fp32) so no numpy
conversion pass is needed: fp16 goes through LLVM's `half` type (F16C / native instructions on
current CPUs), bf16 through integer shifts with round-to-nearest-even, fp32 through a bitcast.
Stores clamp to the largest finite value of the target type, so a decoder never writes Inf.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any, ClassVar

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from tierkv.codecs import DTYPE_CODES


def pin_features() -> None:
    """Compile for the features of the CPU NUMBA_CPU_NAME names (e.g. `haswell`: AVX2, FMA,
    F16C), not the host's: Numba takes the host's unless NUMBA_CPU_FEATURES is set, so a
    `haswell` build on an AVX-512 machine would still use 512-bit registers. Runs when this
    module is imported, before any kernel compiles."""
    if os.environ.get("NUMBA_CPU_NAME") and "NUMBA_CPU_FEATURES" not in os.environ:
        os.environ["NUMBA_CPU_FEATURES"] = ""
        config.reload_config()


def target_name() -> str:
    """The CPU the kernels are compiled for: NUMBA_CPU_NAME, else "native"."""
    return config.CPU_NAME or "native"


def target_features() -> dict[str, bool]:
    """The features the kernels are compiled with, as far as they are known: the host's, or
    those NUMBA_CPU_FEATURES turns on and off for a named CPU (a named CPU's own features,
    which LLVM does not list, count as absent)."""
    if not config.CPU_NAME:
        return dict(binding.get_host_cpu_features())
    flags = (config.CPU_FEATURES or "").split(",")
    return {flag[1:]: flag[0] == "+" for flag in flags if flag[:1] in "+-" and flag[1:]}


pin_features()

FP16, BF16, FP32 = DTYPE_CODES["fp16"], DTYPE_CODES["bf16"], DTYPE_CODES["fp32"]
"""Dtype codes used by the kernels and in the payload header."""

PARALLEL_MIN_BYTES = 8 << 20
"""Blocks at least this large use the multi-threaded kernels; smaller ones run on the calling
thread (a parallel region costs milliseconds when the cores are busy, and ColdTier already
encodes and decodes several blocks at once)."""
CHUNK_VALUES = 1 << 15
"""Values per work item of the multi-threaded kernels."""

_FP16_MAX = np.float32(65504.0)
_BF16_MAX = np.uint32(0x7F7F0000).view(np.float32)
_FP32_MAX = np.float32(np.finfo(np.float32).max)
_MAX_FINITE = np.array([_FP16_MAX, _BF16_MAX, _FP32_MAX], dtype=np.float32)
"""Largest finite value per dtype code."""
_TOP_EXPONENT = 15
"""block_exponent puts a block's largest stored fp16 value in [2**14, 2**15)."""
_EXP_ALL_ONES = np.array([0x7C00, 0x7F80, 0x7F800000], dtype=np.uint32)
"""Bit pattern of +Inf per dtype code; |x| bits at or above it are Inf or NaN."""


class Threaded:
    """A kernel built twice with the same arguments: single-threaded and with prange.

    `kernel(nbytes, *args)` runs the multi-threaded build for blocks of at least
    PARALLEL_MIN_BYTES, one call at a time (Numba's workqueue threading layer is not
    re-entrant), and the single-threaded build on the calling thread otherwise.
    """

    every: ClassVar[list[Threaded]] = []
    _parallel_lock = threading.Lock()

    def __init__(self, serial: Any, parallel: Any) -> None:
        self.serial = serial
        self.parallel = parallel
        Threaded.every.append(self)

    def __call__(self, nbytes: int, *args: Any) -> Any:
        if nbytes >= PARALLEL_MIN_BYTES:
            with Threaded._parallel_lock:
                return self.parallel(*args)
        return self.serial(*args)

    def compile_parallel(self) -> None:
        """Compile (or load from the cache) the multi-threaded build for every signature the
        single-threaded one has seen, without running it: starting the OpenMP pool in a process
        that later forks would hang the children."""
        for signature in self.serial.signatures:
            self.parallel.compile(signature)


@intrinsic
def half_to_f32(typingctx, bits):
    """fp16 bit pattern (uint16) -> float32, exact (subnormals included)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def f32_to_half(typingctx, x):
    """float32 -> fp16 bit pattern (uint16), round to nearest even."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def bits_to_f32(typingctx, bits):
    """Reinterpret a uint32 as float32."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def f32_to_bits(typingctx, x):
    """Reinterpret a float32 as uint32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def load_u64(typingctx, buf, pos):
    """The 8 bytes of a uint8 array `buf` from byte offset `pos` as a little-endian uint64, any
    alignment (one load; the caller keeps pos + 8 <= buf.size)."""
    sig = types.uint64(buf, pos)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        at = builder.gep(array.data, [args[1]])
        return builder.load(builder.bitcast(at, ir.IntType(64).as_pointer()), align=1)

    return sig, codegen


@intrinsic
def copy_u64_pair(typingctx, src, src_at, dst, dst_at):
    """dst[dst_at : dst_at + 2] = src[src_at : src_at + 2] for uint64 arrays, as one 16-byte load
    and one 16-byte store (Numba does not merge the two 8-byte moves itself; the caller keeps both
    ranges in bounds; contiguous arrays only, any alignment)."""
    if src.layout != "C" or dst.layout != "C":
        return None
    sig = types.void(src, src_at, dst, dst_at)

    def codegen(context, builder, signature, args):
        pair = ir.VectorType(ir.IntType(64), 2).as_pointer()

        def at(i: int) -> ir.Value:  # a pointer to element args[i + 1] of the array args[i]
            array = context.make_array(signature.args[i])(context, builder, args[i])
            return builder.bitcast(builder.gep(array.data, [args[i + 1]]), pair)

        builder.store(builder.load(at(0), align=1), at(2), align=1)
        return context.get_dummy_value()

    return sig, codegen


EXPAND_LANES = 512
"""Bits of the vectors expand_merge fills: one AVX-512 register."""
_FEATURES = target_features()
EXPANDS = (
    bool(_FEATURES.get("avx512vbmi2", False)),
    bool(_FEATURES.get("avx512f", False)),
)
"""Whether the CPU compiled for expands (fills chosen lanes from consecutive memory) and
compresses (stores chosen lanes to consecutive memory) a vector of 16-bit words, and of 32-bit
words, in one instruction (x86 AVX-512 VBMI2 and AVX-512F). Elsewhere LLVM turns expand_merge and
compress_split into a branch per lane, far slower than a plain loop. Numba's cache is per CPU
model and features, so code compiled with these values only runs where they hold."""


@njit(cache=True, nogil=True)
def expands(word_bytes):
    """Whether this CPU runs expand_merge and compress_split in single instructions for words of
    word_bytes."""
    if word_bytes == 2:
        return EXPANDS[0]
    return EXPANDS[1] if word_bytes == 4 else False


def _masked_memory(
    context: Any,
    builder: ir.IRBuilder,
    array_type: types.Array,
    mask_type: types.Integer,
    mask: ir.Value,
    operation: str,
) -> tuple[ir.VectorType, ir.Value, ir.Function]:
    """For LLVM's masked-memory intrinsic `operation` ("expandload" or "compressstore") on the
    words of arrays of `array_type`: the vector type of EXPAND_LANES bits of them, the lane mask
    made of the low bits of the integer `mask` (bit i for lane i), and the intrinsic."""
    word = context.get_value_type(array_type.dtype)
    width = 32 if isinstance(word, ir.FloatType) else word.width
    lanes = EXPAND_LANES // width
    vector, bits = ir.VectorType(word, lanes), ir.VectorType(ir.IntType(1), lanes)
    wide = context.cast(builder, mask, mask_type, types.uint64)
    taken = builder.bitcast(builder.trunc(wide, ir.IntType(lanes)), bits)
    if operation == "expandload":  # (pointer, mask, pass-through) -> vector
        kind = ir.FunctionType(vector, [word.as_pointer(), bits, vector])
    else:  # (vector, pointer, mask)
        kind = ir.FunctionType(ir.VoidType(), [vector, word.as_pointer(), bits])
    letter = "f" if isinstance(word, ir.FloatType) else "i"
    name = f"llvm.masked.{operation}.v{lanes}{letter}{width}"
    return vector, taken, cgutils.get_or_insert_function(builder.module, kind, name)


def _data(context: Any, builder: ir.IRBuilder, array_type: types.Array, array: ir.Value) -> Any:
    """The pointer to the first element of a Numba array value."""
    return context.make_array(array_type)(context, builder, array).data


@intrinsic
def expand_merge(typingctx, src, hi_at, lo_at, mask, dst, dst_at):
    """Merge two runs of src into the n = EXPAND_LANES / word bits words dst[dst_at : dst_at + n]:
    the words whose bit is set in `mask` (bit i for word i) take src[hi_at], src[hi_at + 1], ...
    in order, the others src[lo_at], src[lo_at + 1], ... (two masked expand-loads and a store; only
    the words taken are read; C-contiguous arrays of one dtype, any alignment, the caller keeps
    every range in bounds)."""
    if src.layout != "C" or dst.layout != "C" or src.dtype != dst.dtype:
        return None
    sig = types.void(src, hi_at, lo_at, mask, dst, dst_at)

    def codegen(context, builder, signature, args):
        vector, taken, expand = _masked_memory(
            context, builder, signature.args[0], signature.args[3], args[3], "expandload"
        )
        src_data = _data(context, builder, signature.args[0], args[0])
        first = builder.gep(src_data, [args[1]])
        merged = builder.call(expand, [first, taken, ir.Constant(vector, None)])
        rest = builder.gep(src_data, [args[2]])
        merged = builder.call(expand, [rest, builder.not_(taken), merged])
        dst_data = _data(context, builder, signature.args[4], args[4])
        at = builder.bitcast(builder.gep(dst_data, [args[5]]), vector.as_pointer())
        builder.store(merged, at, align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def compress_split(typingctx, src, src_at, mask, dst, hi_at, lo_at):
    """The inverse of expand_merge: of the n = EXPAND_LANES / word bits words src[src_at : src_at
    + n], those whose bit is set in `mask` go to dst[hi_at], dst[hi_at + 1], ... in order, the
    others to dst[lo_at], dst[lo_at + 1], ... (a load and two masked compress-stores; only the
    words stored are written; C-contiguous arrays of one dtype, any alignment, the caller keeps
    every range in bounds)."""
    if src.layout != "C" or dst.layout != "C" or src.dtype != dst.dtype:
        return None
    sig = types.void(src, src_at, mask, dst, hi_at, lo_at)

    def codegen(context, builder, signature, args):
        vector, taken, compress = _masked_memory(
            context, builder, signature.args[0], signature.args[2], args[2], "compressstore"
        )
        src_data = _data(context, builder, signature.args[0], args[0])
        at = builder.bitcast(builder.gep(src_data, [args[1]]), vector.as_pointer())
        words = builder.load(at, align=1)
        dst_data = _data(context, builder, signature.args[3], args[3])
        builder.call(compress, [words, builder.gep(dst_data, [args[4]]), taken])
        builder.call(compress, [words, builder.gep(dst_data, [args[5]]), builder.not_(taken)])
        return context.get_dummy_value()

    return sig, codegen


TRANSPOSE = 16
"""Side of the square blocks transpose_block moves: 16 float32, one AVX-512 register per row."""


@intrinsic
def transpose_block(typingctx, src, src_at, src_stride, dst, dst_at, dst_stride):
    """dst[dst_at + j * dst_stride + i] = src[src_at + i * src_stride + j] for i, j < TRANSPOSE
    (C-contiguous float32 arrays, any alignment; the caller keeps both blocks in bounds): the
    rows are loaded into vector registers and transposed in log2(TRANSPOSE) rounds of two-input
    shuffles, where a plain loop reads or writes one float at a time."""
    if src.layout != "C" or dst.layout != "C":
        return None
    sig = types.void(src, src_at, src_stride, dst, dst_at, dst_stride)

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.FloatType(), TRANSPOSE)
        index = ir.VectorType(ir.IntType(32), TRANSPOSE)

        def rows(i: int) -> list[ir.Value]:  # pointers to the block's rows in array args[i]
            data = _data(context, builder, signature.args[i], args[i])
            stride = context.cast(builder, args[i + 2], signature.args[i + 2], types.intp)
            start = context.cast(builder, args[i + 1], signature.args[i + 1], types.intp)
            return [
                builder.bitcast(
                    builder.gep(
                        data, [builder.add(start, builder.mul(stride, ir.Constant(stride.type, r)))]
                    ),
                    vector.as_pointer(),
                )
                for r in range(TRANSPOSE)
            ]

        regs = [builder.load(pointer, align=4) for pointer in rows(0)]
        # Round h swaps bit h of the row with bit h of the lane: rows r and r + h (bit h clear in
        # r) trade their lanes with bit h set for the other's lanes with it clear.
        h = 1
        while h < TRANSPOSE:
            low = ir.Constant(
                index,
                [lane if lane & h == 0 else TRANSPOSE + lane - h for lane in range(TRANSPOSE)],
            )
            high = ir.Constant(
                index,
                [lane + h if lane & h == 0 else TRANSPOSE + lane for lane in range(TRANSPOSE)],
            )
            for r in range(TRANSPOSE):
                if r & h == 0:
                    a, b = regs[r], regs[r + h]
                    regs[r] = builder.shuffle_vector(a, b, low)
                    regs[r + h] = builder.shuffle_vector(a, b, high)
            h *= 2
        for pointer, reg in zip(rows(3), regs, strict=True):
            builder.store(reg, pointer, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_le(typingctx, buf, pos, value):
    """Write the unsigned integer `value` (uint16, uint32 or uint64) into a uint8 array `buf` at
    byte offset `pos`, little-endian, any alignment (one store; the caller keeps pos plus its
    size <= buf.size)."""
    sig = types.void(buf, pos, value)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        at = builder.gep(array.data, [args[1]])
        pointer = context.get_value_type(signature.args[2]).as_pointer()
        builder.store(args[2], builder.bitcast(at, pointer), align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def max_abs_bits(words, code):
    """Largest |x| of `words` as a bit pattern (monotonic in |x|); >= nonfinite_bits(code) means
    a NaN or Inf is present. An integer reduction kept at the word width (the explicit casts stop
    Numba widening to int64), so it vectorizes."""
    if code == FP32:
        m32 = np.uint32(0)
        for i in range(words.size):
            m32 = np.uint32(max(m32, np.uint32(np.uint32(words[i]) & np.uint32(0x7FFFFFFF))))
        return m32
    m16 = np.uint16(0)
    for i in range(words.size):
        m16 = np.uint16(max(m16, np.uint16(np.uint16(words[i]) & np.uint16(0x7FFF))))
    return np.uint32(m16)


@njit(cache=True, nogil=True)
def nonfinite_bits(code):
    """The smallest |x| bit pattern that is Inf (NaNs are above it)."""
    return _EXP_ALL_ONES[code]


@njit(cache=True, nogil=True)
def bits_value(bits, code):
    """float32 value of a single word given as uint32 bits."""
    if code == FP16:
        return half_to_f32(np.uint16(bits))
    if code == BF16:
        return bits_to_f32(bits << np.uint32(16))
    return bits_to_f32(bits)


@njit(cache=True, nogil=True)
def to_f32(words, code, buf):
    """buf[i] = float32 value of words[i] (loops split per dtype so each one vectorizes)."""
    if code == FP16:
        for i in range(words.size):
            buf[i] = half_to_f32(np.uint16(words[i]))
    elif code == BF16:
        for i in range(words.size):
            buf[i] = bits_to_f32(np.uint32(words[i]) << np.uint32(16))
    else:
        for i in range(words.size):
            buf[i] = bits_to_f32(np.uint32(words[i]))


@njit(cache=True, nogil=True, inline="always")
def fp16_word(x):
    """float32 -> fp16 bits, clamped to the finite range, rounded to nearest even."""
    return f32_to_half(min(max(x, -_FP16_MAX), _FP16_MAX))


@njit(cache=True, nogil=True, inline="always")
def bf16_word(x):
    """float32 -> bf16 bits (uint16), clamped to the finite range, rounded to nearest even."""
    return bf16_round(min(max(x, -_BF16_MAX), _BF16_MAX))


@intrinsic
def bf16_round(typingctx, x):
    """float32 -> bf16 bits (uint16), rounded to nearest even, for x within the finite range (a
    larger one rounds to Inf): bits + 0x7FFF + (bit 16), the top half. In 32-bit arithmetic,
    which Numba's own integer arithmetic widens to 64 bits, a vector of half the lanes (3.5x
    slower to convert)."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        u = builder.bitcast(args[0], i32)
        odd = builder.and_(builder.lshr(u, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.add(builder.add(u, ir.Constant(i32, 0x7FFF)), odd)
        return builder.trunc(builder.lshr(rounded, ir.Constant(i32, 16)), ir.IntType(16))

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def max_finite(code):
    """The largest finite value of dtype `code`, as float64."""
    return np.float64(_MAX_FINITE[code])


@njit(cache=True, nogil=True, inline="always")
def fp32_word(x):
    """float32 -> its bits, clamped to the finite range."""
    return f32_to_bits(min(max(x, -_FP32_MAX), _FP32_MAX))


@njit(cache=True, nogil=True)
def from_f32(buf, code, words):
    """words[i] = buf[i] in dtype `code`, clamped to its finite range, rounded to nearest even."""
    if code == FP16:
        for i in range(words.size):
            words[i] = fp16_word(buf[i])
    elif code == BF16:
        for i in range(words.size):
            words[i] = bf16_word(buf[i])
    else:
        for i in range(words.size):
            words[i] = fp32_word(buf[i])


@njit(cache=True, nogil=True)
def read_u16(buf, pos):
    """Little-endian uint16 at byte offset `pos` of a uint8 buffer (any alignment)."""
    return np.uint16(buf[pos]) | (np.uint16(buf[pos + 1]) << np.uint16(8))


@njit(cache=True, nogil=True)
def write_u16(buf, pos, value):
    """Write `value` as a little-endian uint16 at byte offset `pos` of a uint8 buffer."""
    v = np.uint16(value)
    buf[pos] = np.uint8(v & np.uint16(0xFF))
    buf[pos + 1] = np.uint8(v >> np.uint16(8))


@njit(cache=True, nogil=True)
def pow2(k):
    """2**k as float64 (exact for the exponents the codecs use)."""
    return math.ldexp(1.0, k)


@njit(cache=True, nogil=True)
def block_exponent(max_value):
    """k such that max_value * 2**-k lies in [2**14, 2**15); 0 for an all-zero block.

    Clamped to [-126, 127] so 2**k and 2**-k are both normal float32 numbers.
    """
    if max_value <= 0.0:
        return 0
    _, e = math.frexp(max_value)
    return min(max(e - _TOP_EXPONENT, -126), 127)
