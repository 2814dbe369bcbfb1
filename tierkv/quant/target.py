"""What vector instructions the codec kernels get on the CPU they are compiled for.

`instruction_set` reads the assembly of a small probe kernel compiled the way the kernels are
(for the host, or for NUMBA_CPU_NAME: see kernels.pin_features), so what it reports is what the
compiler emitted, not what was asked for.
"""

from __future__ import annotations

import functools
import platform
import re
from dataclasses import dataclass

import numpy as np
from numba import njit

from tierkv.quant.kernels import f32_to_half, half_to_f32, target_name


@njit(nogil=True, fastmath={"contract"})
def _probe(halves, x, words):
    """fp16 -> float32, a multiply-add and back, and an integer add: what the codec kernels'
    inner loops use, so the assembly shows the widest registers and which conversions and fused
    operations they get."""
    for i in range(x.size):
        x[i] = half_to_f32(halves[i]) * x[i] + np.float32(1.0)
        halves[i] = f32_to_half(x[i])
        words[i] += np.uint32(3)


@dataclass(frozen=True)
class InstructionSet:
    """What the probe kernel was compiled to: vector width and the extensions seen."""

    bits: int
    extensions: tuple[str, ...]

    def __str__(self) -> str:
        names = " ".join(self.extensions) or "scalar"
        return f"{target_name()}: {names}, {self.bits}-bit"


@functools.cache
def instruction_set() -> InstructionSet:
    """The vector width and extensions of code compiled in this process (compiles the probe
    once, uncached, so its assembly can be read)."""
    n = 64
    _probe(np.zeros(n, np.uint16), np.zeros(n, np.float32), np.zeros(n, np.uint32))
    asm = "\n".join(_probe.inspect_asm().values())
    if platform.machine().lower() in ("arm64", "aarch64"):
        return InstructionSet(128, ("NEON",))
    extensions = []
    if "zmm" in asm:
        bits = 512
        extensions.append("AVX-512")
    elif "ymm" in asm:
        bits = 256
        integer_ymm = re.search(r"vpaddd\s[^\n]*%ymm", asm) is not None
        extensions.append("AVX2" if integer_ymm else "AVX")
    else:
        bits = 128 if "xmm" in asm else 64
        if "xmm" in asm:
            extensions.append("SSE")
    if "vfmadd" in asm:
        extensions.append("FMA")
    if "vcvtph2ps" in asm:
        extensions.append("F16C")
    return InstructionSet(bits, tuple(extensions))
