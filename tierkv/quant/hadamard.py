"""Walsh-Hadamard butterflies held in SIMD registers, for the TurboQuant decoder.

`butterflies(y, start, step, count, size, first)` runs the butterfly stages of coordinate distance
first, 2 * first, ..., size / 2 on each of y[start + i * step :][:size] (float32), i < count, in
place (one call for the vectors of a tile: a call per vector would cost two atomic reference
counts of y, as much as its butterflies). Each pair (a, b) becomes (a + b, a - b), stage by
stage, exactly as the textbook loop does, so the result is bit for bit the same whichever way it
runs: up to 256 values with `fwht` (a Numba intrinsic, written as LLVM vector IR, for the
combinations of size and first it is built for, `fwht_fits`), the stages past 256 values as
loops over whole runs of values (which vectorize), and sizes under 16 values as a scalar loop.

The values are loaded once, into vectors of LANES floats: stages of distance LANES and up pair
whole vectors; shorter ones pair lanes within a vector (a lane swap, an add, a subtract and a
blend per vector). LLVM lowers the vectors to what the CPU has (AVX-512, AVX2, NEON). A scalar loop
over one vector's coordinates needs a pass through memory per stage, and at short distances does
not vectorize at all.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

LANES = 16
"""Floats per vector register of the generated code (one AVX-512 register, two AVX2 ones)."""
SIZES = (16, 32, 64, 128, 256)
"""Transform sizes built: the powers of two from 16 (one vector) to 256 (the head dims of common
models, and the Hadamard blocks of a quarter or three quarters of one)."""
FIRSTS = (1, 2, 4)
"""First stage distances built: the powers of two from 1 to 4 (the decoder's look-up tables may
already have done the stages of distance 1 and 2)."""


@njit(cache=True, nogil=True)
def _power_of_two_in(value, low, high):
    """Whether `value` is a power of two in [low, high]."""
    return low <= value <= high and value & (value - 1) == 0


@njit(cache=True, nogil=True)
def fwht_fits(size, first):
    """Whether `fwht` is built for a transform of `size` values from stage distance `first`."""
    low, high = SIZES[0], SIZES[-1]
    return _power_of_two_in(size, low, high) and _power_of_two_in(first, FIRSTS[0], FIRSTS[-1])


def _butterflies(builder: ir.IRBuilder, regs: list[ir.Value], first: int) -> None:
    """The stages of distance first .. len(regs) * LANES / 2 on the vectors `regs`, in place."""
    size = len(regs) * LANES
    index = ir.VectorType(ir.IntType(32), LANES)
    distance = first
    while distance < size:
        if distance >= LANES:
            step = distance // LANES
            for base in range(0, len(regs), 2 * step):
                for i in range(base, base + step):
                    a, b = regs[i], regs[i + step]
                    regs[i], regs[i + step] = builder.fadd(a, b), builder.fsub(a, b)
        else:
            swap = ir.Constant(index, [lane ^ distance for lane in range(LANES)])
            # lanes without the distance bit keep a + b, the others take their partner's a - b
            blend = ir.Constant(
                index, [lane + LANES * bool(lane & distance) for lane in range(LANES)]
            )
            for i, v in enumerate(regs):
                partner = builder.shuffle_vector(v, v, swap)
                sums, differences = builder.fadd(v, partner), builder.fsub(partner, v)
                regs[i] = builder.shuffle_vector(sums, differences, blend)
        distance *= 2


@intrinsic
def fwht(typingctx, y, start, size, first):
    """See the module docstring."""
    sig = types.void(y, start, size, first)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        vector = ir.VectorType(ir.FloatType(), LANES)
        at = builder.bitcast(builder.gep(array.data, [args[1]]), vector.as_pointer())
        i64 = ir.IntType(64)
        size_value, first_value = (
            context.cast(builder, value, kind, types.intp)
            for value, kind in zip(args[2:], signature.args[2:], strict=True)
        )
        key = builder.add(builder.mul(size_value, ir.Constant(size_value.type, 8)), first_value)
        done = builder.append_basic_block("fwht.done")
        switch = builder.switch(key, done)
        for case_size in SIZES:
            for case_first in FIRSTS:
                block = builder.append_basic_block(f"fwht.{case_size}.{case_first}")
                switch.add_case(ir.Constant(key.type, case_size * 8 + case_first), block)
                builder.position_at_end(block)
                pointers = [
                    builder.gep(at, [ir.Constant(i64, i)]) for i in range(case_size // LANES)
                ]
                regs = [builder.load(pointer, align=4) for pointer in pointers]
                _butterflies(builder, regs, case_first)
                for pointer, reg in zip(pointers, regs, strict=True):
                    builder.store(reg, pointer, align=4)
                builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def butterflies(y, start, step, count, size, first):
    """The transforms of `size` values at y[start + i * step], i < count (see the module
    docstring; size a power of two, first a power of two below it). Indices are cast to
    unsigned, so Numba checks none for wraparound and the loops vectorize."""
    top = min(size, SIZES[-1])
    in_registers = fwht_fits(top, first)
    for i in range(count):
        at = start + i * step
        distance = first
        if in_registers:
            for chunk in range(at, at + size, top):
                fwht(y, chunk, top, first)
            distance = top
        while distance < size:
            for block in range(at, at + size, 2 * distance):
                for j in range(block, block + distance):
                    a = y[np.uint64(j)]
                    b = y[np.uint64(j + distance)]
                    y[np.uint64(j)] = a + b
                    y[np.uint64(j + distance)] = a - b
            distance *= 2
