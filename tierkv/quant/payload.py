"""The self-describing payload header, the codec errors, and input / output array checks.

Every payload starts with a little-endian header:

    magic "TKVQ" | version u8 | codec id u8 | dtype u8 | ndim u8 | group_size u32
    | bits_hi u8 | bits_lo u8 | hi_channels u16 | body_bytes u64 | shape ndim x u64 | crc32 u32

`crc32` covers every header byte before it, so a corrupted header is always detected; the body is
protected by the vault's xxh3 checksum and its exact length is checked here. `bits_hi`, `bits_lo`
and `hi_channels` spell out the bit layout (TurboQuant's mixed modes keep `hi_channels` channels
at `bits_hi` bits and the rest at `bits_lo`) and must match what the codec id implies.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierkv.codecs import (
    CODEC_NAMES,
    DTYPE_BYTES,
    DTYPE_CODES,
    DTYPES,
    FRAMEWORK_DTYPES,
    LOSSY_BIT_LAYOUTS,
)

FORMAT_VERSION = 2
"""Version written. 2 changed only TurboQuant's rotation of a non-power-of-two number of channels
(see codebooks.Rotation), which tq3.5 and tq2.5 use; version 1 payloads still decode."""
READ_VERSIONS = (1, 2)
MAGIC = b"TKVQ"
MAX_NDIM = 8

WORD_TYPES: dict[int, type[np.unsignedinteger]] = {2: np.uint16, 4: np.uint32}

_FLOAT_DTYPES = {
    np.dtype(name): ours for name, ours in FRAMEWORK_DTYPES.items() if hasattr(np, name)
}
"""numpy float types and the only dtype each can hold (numpy has no bfloat16: ml_dtypes' is kind
"V"); integer views hold raw words of any."""


def _float_dtype(array_dtype: np.dtype) -> str | None:
    """The dtype a float16 / float32 / bfloat16 array holds, None for other (integer) arrays."""
    if array_dtype.kind == "V":  # ml_dtypes' bfloat16
        return FRAMEWORK_DTYPES.get(array_dtype.name)
    return _FLOAT_DTYPES.get(array_dtype)


_FIXED = struct.Struct("<4sBBBBIBBHQ")
_CRC = struct.Struct("<I")


class PayloadError(ValueError):
    """A payload is malformed, truncated or does not match the output array."""


class NonFiniteError(ValueError):
    """The input block holds NaN or Inf; the caller skips the block."""


@dataclass(frozen=True)
class BitLayout:
    """How many bits each value gets: `hi_channels` channels per group at `hi`, the rest at `lo`."""

    hi: int
    lo: int
    hi_channels: int


@dataclass(frozen=True)
class PayloadHeader:
    """What a payload holds: codec, format version, input dtype, shape, group size, bits/value."""

    codec: str
    version: int
    dtype: str
    shape: tuple[int, ...]
    group_size: int
    bits: float

    @functools.cached_property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class PayloadRun:
    """Payloads of one length lying back to back in `data` (uint8), `stride` bytes each, each
    header `head` bytes long; the ones to decode are at positions `at` (int64)."""

    data: np.ndarray
    stride: int
    head: int
    at: np.ndarray


def back_to_back_runs(payloads: Sequence[bytes | memoryview]) -> list[range]:
    """The positions of `payloads` split into runs, in order, whose payloads have one length
    and lie back to back in memory (as promoted payloads do in one receive buffer)."""
    runs: list[range] = []
    end = -1
    for at, payload in enumerate(payloads):
        start = np.frombuffer(payload, np.uint8).ctypes.data if len(payload) else -2
        if runs and start == end and len(payload) == len(payloads[runs[-1].start]):
            runs[-1] = range(runs[-1].start, at + 1)
        else:
            runs.append(range(at, at + 1))
        end = start + len(payload)
    return runs


def bit_layout(codec: str, group_size: int, dtype: str) -> BitLayout:
    """The bit layout codec `codec` uses for groups of `group_size` values of `dtype`."""
    if codec == "none":
        bits = 8 * DTYPE_BYTES[dtype]
        return BitLayout(bits, bits, 0)
    hi, lo, mixed = LOSSY_BIT_LAYOUTS[codec]
    return BitLayout(hi, lo, group_size // 4 if mixed else 0)


def nominal_bits(layout: BitLayout, group_size: int) -> float:
    """Average bits per value of the quantized indices (norms and scales not counted)."""
    return (layout.hi * layout.hi_channels + layout.lo * (group_size - layout.hi_channels)) / (
        group_size
    )


@functools.lru_cache(maxsize=1024)
def pack_header(
    codec: str, dtype: str, shape: tuple[int, ...], group_size: int, body_bytes: int
) -> bytes:
    """The header bytes of a payload with `body_bytes` bytes of body (cached: blocks of one
    shape share their header)."""
    layout = bit_layout(codec, group_size, dtype)
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        CODEC_NAMES.index(codec),
        DTYPE_CODES[dtype],
        len(shape),
        group_size,
        layout.hi,
        layout.lo,
        layout.hi_channels,
        body_bytes,
    )
    head = fixed + struct.pack(f"<{len(shape)}Q", *shape)
    return head + _CRC.pack(zlib.crc32(head))


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_BYTES_DATA_OFFSET = bytes.__basicsize__ - 1
"""Where a bytes object's characters start (its basic size counts the trailing NUL)."""


class _BytesWindow:
    """A writable numpy view of a bytes object still being built (holds it alive)."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, owner: bytes) -> None:
        self.owner = owner
        self.__array_interface__ = {
            "data": (id(owner) + _BYTES_DATA_OFFSET, False),
            "shape": (len(owner),),
            "typestr": "|u1",
            "version": 3,
        }


def new_payload(header: bytes, body_bytes: int) -> tuple[bytes, np.ndarray]:
    """A payload of `header` and `body_bytes` bytes still to be written, and a writable uint8 view
    of that body. Kernels write straight into the returned bytes object, as CPython itself builds
    one (PyBytes_FromStringAndSize(NULL, n), then fill), so no payload is copied after encoding;
    fill the view before the bytes object is used or shared."""
    payload = _new_bytes(None, len(header) + body_bytes)
    view = np.asarray(_BytesWindow(payload))
    view[: len(header)] = np.frombuffer(header, np.uint8)
    return payload, view[len(header) :]


def header_bytes(ndim: int) -> int:
    """Length of a header for an `ndim`-dimensional shape."""
    return _FIXED.size + 8 * ndim + _CRC.size


def parse_header(payload: bytes | bytearray | memoryview) -> tuple[PayloadHeader, memoryview]:
    """Validate the header of `payload`; returns it and the body (exact length checked)."""
    view = memoryview(payload).cast("B")
    if len(view) < _FIXED.size:
        raise PayloadError(
            f"payload too short: {len(view)} bytes, a header needs at least {header_bytes(0)}"
        )
    magic, version, codec_id, dtype_code, ndim, group_size, hi, lo, hi_ch, body = _FIXED.unpack(
        view[: _FIXED.size]
    )
    if magic != MAGIC:
        raise PayloadError(f"not a tierkv payload: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version not in READ_VERSIONS:
        raise PayloadError(
            f"unsupported payload format version {version} (this tierkv reads "
            f"{', '.join(map(str, READ_VERSIONS))})"
        )
    if ndim > MAX_NDIM:
        raise PayloadError(f"corrupted header: ndim {ndim} > {MAX_NDIM}")
    head_len = header_bytes(ndim)
    if len(view) < head_len:
        raise PayloadError(f"payload truncated: {len(view)} bytes, its header alone is {head_len}")
    (crc,) = _CRC.unpack(view[head_len - _CRC.size : head_len])
    if crc != zlib.crc32(view[: head_len - _CRC.size]):
        raise PayloadError("corrupted header: header checksum mismatch")
    if codec_id >= len(CODEC_NAMES):
        raise PayloadError(f"unknown codec id {codec_id} in payload header")
    if dtype_code >= len(DTYPES):
        raise PayloadError(f"unknown dtype code {dtype_code} in payload header")
    codec, dtype = CODEC_NAMES[codec_id], DTYPES[dtype_code]
    shape = struct.unpack(f"<{ndim}Q", view[_FIXED.size : head_len - _CRC.size])
    if group_size < 1:
        raise PayloadError(f"invalid group_size {group_size} in {codec} payload header")
    layout = bit_layout(codec, group_size, dtype)
    if (hi, lo, hi_ch) != (layout.hi, layout.lo, layout.hi_channels):
        raise PayloadError(
            f"{codec} payload header has bit layout {hi}/{lo}/{hi_ch}, expected "
            f"{layout.hi}/{layout.lo}/{layout.hi_channels}"
        )
    if len(view) != head_len + body:
        raise PayloadError(
            f"{codec} payload is {len(view)} bytes but its header says {head_len + body} "
            "(truncated or padded)"
        )
    header = PayloadHeader(
        codec, version, dtype, shape, group_size, nominal_bits(layout, group_size)
    )
    return header, view[head_len:]


def read_header(payload: bytes | bytearray | memoryview) -> PayloadHeader:
    """The validated header of `payload` (PayloadError when malformed or truncated)."""
    return parse_header(payload)[0]


def input_words(src: np.ndarray, dtype: str | None) -> tuple[np.ndarray, str]:
    """`src` as a flat array of raw words (uint16 / uint32) and its dtype name.

    dtype is inferred from float16 / float32 arrays; bf16 arrives as a 16-bit integer view (or an
    ml_dtypes bfloat16 array) and must be declared dtype="bf16".
    """
    if not isinstance(src, np.ndarray):
        raise TypeError(f"codec input must be a numpy array, got {type(src).__name__}")
    kind = _input_kinds.get((src.dtype, dtype))
    if kind is None:
        kind = _input_kinds[src.dtype, dtype] = _input_kind(src.dtype, dtype)
    if src.ndim > MAX_NDIM:
        raise ValueError(f"codec input has {src.ndim} dimensions, at most {MAX_NDIM}")
    words = np.ascontiguousarray(src).reshape(-1).view(kind[1])
    words.flags.writeable = False  # one kernel specialisation whatever the caller passes
    return words, kind[0]


_input_kinds: dict[tuple[np.dtype, str | None], tuple[str, type[np.unsignedinteger]]] = {}
"""(array dtype, declared dtype) pairs input_words accepted -> _input_kind's answer."""


def _input_kind(array_dtype: np.dtype, dtype: str | None) -> tuple[str, type[np.unsignedinteger]]:
    """The dtype name an array of `array_dtype` declared `dtype` holds and its word type; raises
    ValueError when the array cannot hold that dtype."""
    if array_dtype.byteorder == ">":
        raise ValueError(f"codec input must be little-endian, got dtype {array_dtype}")
    if dtype is None:
        inferred = _float_dtype(array_dtype)
        if inferred is None:
            raise ValueError(
                f"cannot infer the element type of a {array_dtype} array: pass dtype='fp16', "
                "'bf16' or 'fp32' (bf16 comes as a uint16/int16 view)"
            )
        dtype = inferred
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if array_dtype.itemsize != DTYPE_BYTES[dtype] or array_dtype.kind not in "fiuV":
        raise ValueError(
            f"dtype {dtype!r} needs {DTYPE_BYTES[dtype]}-byte elements, got a {array_dtype} array"
        )
    if _float_dtype(array_dtype) not in (None, dtype):
        raise ValueError(f"a {array_dtype} array cannot hold {dtype!r} values")
    return dtype, WORD_TYPES[DTYPE_BYTES[dtype]]


def output_words(out: np.ndarray, header: PayloadHeader) -> np.ndarray:
    """`out` as a flat writable word array after checking it fits `header` (else PayloadError)."""
    if not isinstance(out, np.ndarray):
        raise PayloadError(f"output must be a numpy array, got {type(out).__name__}")
    if out.dtype.itemsize != DTYPE_BYTES[header.dtype] or (
        _float_dtype(out.dtype) not in (None, header.dtype)
    ):
        raise PayloadError(
            f"output array has {out.dtype.itemsize}-byte elements ({out.dtype}) but the payload "
            f"holds {header.dtype}"
        )
    if out.size != header.size:
        raise PayloadError(
            f"output array has {out.size} elements (shape {out.shape}) but the payload holds "
            f"{header.size} (shape {header.shape})"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise PayloadError("output array must be C-contiguous and writable")
    return out.reshape(-1).view(WORD_TYPES[out.dtype.itemsize])
