"""K/V pair codecs: keys through one codec, values through another, in one payload (format 3).

Keys are more sensitive to quantization than values, so a pair such as "k8v4" (int8 keys, tq4
values) keeps most of the saving at a fraction of the error. A block holds keys then values
along one axis; the caller says which and how many keys (`kv_split` = (axis, keys): vLLM's
`[..., head_size | head_size_v]` splits the last axis at head_size, a K/V-first layout axis 1 at
1). A block of keys only (keys = the axis' length) or values only (0), as EXO stores them, is
just that codec's ordinary payload. A block holding both becomes

    magic "TKVQ" | version u8 = 3 | keys codec id u8 | values codec id u8 | dtype u8 | ndim u8
    | split axis u8 | keys along it u32 | keys payload bytes u64 | values payload bytes u64
    | shape ndim x u64 | crc32 u32 | keys payload | values payload

where both inner payloads are complete single-codec payloads (formats 1-2). The version byte sits
where those have it, so a reader that knows only formats 1 and 2 refuses a pair payload
("unsupported payload format version 3") instead of decoding it as something else.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tierkv.codecs import CODEC_NAMES, DTYPE_CODES, DTYPES, kv_pair_name
from tierkv.quant.base import Codec
from tierkv.quant.payload import (
    MAGIC,
    MAX_NDIM,
    PayloadError,
    input_words,
    parse_header,
)
from tierkv.quant.sinks import Sinks, SinkTurboCodec

PAIR_FORMAT_VERSION = 3
_FIXED = struct.Struct("<4sBBBBBBIQQ")
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class PairHeader:
    """What a pair payload holds: both codecs, dtype, the block's shape and where K and V split."""

    keys: str
    values: str
    dtype: str
    shape: tuple[int, ...]
    axis: int
    keys_count: int

    def halves(self) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """Index expressions of the keys and the values in the block."""
        lead = (slice(None),) * self.axis
        return (*lead, slice(0, self.keys_count)), (*lead, slice(self.keys_count, None))


class PairCodec:
    """Keys through `keys`, values through `values`; the payload records both codecs."""

    def __init__(self, keys: Codec, values: Codec) -> None:
        if keys.group_size != values.group_size:
            raise ValueError("a K/V pair needs one group size for both codecs")
        self.keys, self.values = keys, values
        self.name = kv_pair_name(keys.name, values.name)
        self.group_size = keys.group_size

    def encode(
        self,
        src: np.ndarray,
        dtype: str | None = None,
        kv_split: tuple[int, int] | None = None,
        sink_tokens: Sinks | None = None,
    ) -> bytes:
        """Payload of `src`, which holds keys then values along axis `kv_split[0]`, the first
        `kv_split[1]` of it keys. ValueError without a split: keys are never guessed.
        `sink_tokens` (token axis, count): for a half whose codec keeps sink tokens (both halves
        keep the block's axes)."""
        if kv_split is None:
            raise ValueError(f"{self.name}: the caller did not say where keys and values split")
        axis, count = kv_split
        if not -src.ndim <= axis < src.ndim or not 0 <= count <= src.shape[axis]:
            raise ValueError(f"K/V split {kv_split} does not fit a block of shape {src.shape}")
        axis %= src.ndim
        if count == src.shape[axis]:
            return _encode(self.keys, src, dtype, sink_tokens)
        if count == 0:
            return _encode(self.values, src, dtype, sink_tokens)
        _, dtype = input_words(src, dtype)
        shape = tuple(src.shape)
        header = PairHeader(self.keys.name, self.values.name, dtype, shape, axis, count)
        key_index, value_index = header.halves()
        keys = _encode(self.keys, np.ascontiguousarray(src[key_index]), dtype, sink_tokens)
        values = _encode(self.values, np.ascontiguousarray(src[value_index]), dtype, sink_tokens)
        head = _FIXED.pack(
            MAGIC,
            PAIR_FORMAT_VERSION,
            CODEC_NAMES.index(self.keys.name),
            CODEC_NAMES.index(self.values.name),
            DTYPE_CODES[dtype],
            len(shape),
            axis,
            count,
            len(keys),
            len(values),
        ) + struct.pack(f"<{len(shape)}Q", *shape)
        return b"".join((head, _CRC.pack(zlib.crc32(head)), keys, values))


def _encode(codec: Codec, src: np.ndarray, dtype: str | None, sink_tokens: Sinks | None) -> bytes:
    """codec.encode(src, dtype), with `sink_tokens` for a codec that keeps them."""
    if isinstance(codec, SinkTurboCodec):
        return codec.encode(src, dtype, sink_tokens)
    return codec.encode(src, dtype)


def is_pair(payload: bytes | bytearray | memoryview) -> bool:
    """Whether `payload` is a format-3 (K/V pair) payload."""
    view = memoryview(payload).cast("B")
    return len(view) > 4 and view[4] == PAIR_FORMAT_VERSION and bytes(view[:4]) == MAGIC


def parse_pair(
    payload: bytes | bytearray | memoryview,
) -> tuple[PairHeader, memoryview, memoryview]:
    """The validated header of a pair payload and its keys and values payloads."""
    view = memoryview(payload).cast("B")
    if len(view) < _FIXED.size:
        raise PayloadError(f"K/V pair payload too short: {len(view)} bytes")
    magic, version, k_id, v_id, dtype_code, ndim, axis, count, k_len, v_len = _FIXED.unpack(
        view[: _FIXED.size]
    )
    if magic != MAGIC or version != PAIR_FORMAT_VERSION:
        raise PayloadError(f"not a K/V pair payload (magic {bytes(magic)!r}, version {version})")
    if ndim == 0 or ndim > MAX_NDIM:
        raise PayloadError(f"corrupted K/V pair header: ndim {ndim}")
    head_len = _FIXED.size + 8 * ndim
    if len(view) < head_len + _CRC.size:
        raise PayloadError(f"K/V pair payload truncated: {len(view)} bytes")
    (crc,) = _CRC.unpack(view[head_len : head_len + _CRC.size])
    if crc != zlib.crc32(view[:head_len]):
        raise PayloadError("corrupted K/V pair header: header checksum mismatch")
    if k_id >= len(CODEC_NAMES) or v_id >= len(CODEC_NAMES) or dtype_code >= len(DTYPES):
        raise PayloadError(f"unknown codec or dtype in K/V pair header ({k_id}, {v_id})")
    shape = struct.unpack(f"<{ndim}Q", view[_FIXED.size : head_len])
    if axis >= ndim or not 0 < count < shape[axis]:
        raise PayloadError(f"K/V pair split ({axis}, {count}) does not fit shape {shape}")
    body = head_len + _CRC.size
    if len(view) != body + k_len + v_len:
        raise PayloadError(
            f"K/V pair payload is {len(view)} bytes but its header says {body + k_len + v_len}"
        )
    header = PairHeader(
        CODEC_NAMES[k_id], CODEC_NAMES[v_id], DTYPES[dtype_code], shape, axis, count
    )
    return header, view[body : body + k_len], view[body + k_len :]


def decode_pair_into(
    payload: bytes | bytearray | memoryview,
    out: np.ndarray,
    decode_into: Callable[[memoryview, np.ndarray], None],
) -> None:
    """Decode a pair payload into `out` (checked like any payload), each half with `decode_into`.

    Each inner payload must be the codec, dtype and half-shape the outer header records."""
    header, keys, values = parse_pair(payload)
    if out.size != math.prod(header.shape) or not (out.flags.c_contiguous and out.flags.writeable):
        raise PayloadError(
            f"output array of shape {out.shape} does not fit a K/V pair of shape {header.shape} "
            "(or is not C-contiguous and writable)"
        )
    whole = out.reshape(header.shape)
    key_index, value_index = header.halves()
    halves = ((keys, header.keys, key_index), (values, header.values, value_index))
    for inner, codec, index in halves:
        inner_header = parse_header(inner)[0]
        part = whole[index].shape
        if (inner_header.codec, inner_header.dtype, inner_header.shape) != (
            codec,
            header.dtype,
            part,
        ):
            raise PayloadError(
                f"K/V pair half is {inner_header.codec} {inner_header.dtype} "
                f"{inner_header.shape}, its header says {codec} {header.dtype} {part}"
            )
        staging = np.empty(part, out.dtype)
        decode_into(inner, staging)
        whole[index] = staging
