"""Encode and decode payloads with MLX, where EXO's KV lives (the GPU on Apple Silicon): the same
payloads as the Numba kernels.

INT8 is bit for bit the Numba result both ways (the same float32 operations; the per-group
scales and steps are computed on the host in float64 as the kernels do). TurboQuant rotates with
MLX's Walsh–Hadamard transform and the q x q mix of format 2 (a format-1 payload's dense matrix
on decode) instead of the kernels' butterflies, so it matches within float32 rounding: a decoded
value to about one unit in the last place, and an encoded index only where a rotated coordinate
sits within rounding of a decision boundary (a different index, or an fp16 norm one unit apart).
The mixed modes' channel energies are summed in float32 (the kernels use float64), of the block
scaled by 2**-k, which picks the same channels unless two have energies equal to about 1e-6.
Tested with mlx[cpu]; Metal is untested. Only this module of tierkv.quant imports MLX.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from tierkv.codecs import DTYPE_BYTES, DTYPE_CODES, FRAMEWORK_DTYPES
from tierkv.quant import int8, lossless, sinks, turbo
from tierkv.quant.base import Codec, CodecFamily
from tierkv.quant.codec import FAMILY_OF, checked_body
from tierkv.quant.kernels import BF16, FP16, FP32, bits_value, block_exponent, nonfinite_bits
from tierkv.quant.pair import PairCodec
from tierkv.quant.payload import MAX_NDIM, NonFiniteError, PayloadHeader, new_payload, pack_header
from tierkv.quant.turbo import Instance, TurboCodec, index_positions, named_codec, packed_bytes

_DTYPE_OF = {getattr(mx, name): ours for name, ours in FRAMEWORK_DTYPES.items()}
_MX_TYPES = {ours: mx_type for mx_type, ours in _DTYPE_OF.items()}
_WORD_TYPES = {2: mx.uint16, 4: mx.uint32}
_ABS_MASKS = {FP16: 0x7FFF, BF16: 0x7FFF, FP32: 0x7FFFFFFF}
"""Everything but the sign bit: the word of |x|, which orders like |x| (as kernels.max_abs_bits)."""
_MAX_FINITE = {"fp16": 65504.0, "bf16": float(np.uint32(0x7F7F0000).view(np.float32)), "fp32": None}


def encode(
    codec: Codec,
    src: mx.array,
    dtype: str | None = None,
    kv_split: tuple[int, int] | None = None,
) -> bytes:
    """The payload `codec.encode` makes for the same values, computed with MLX.

    dtype is inferred from float16 / bfloat16 / float32 arrays; integer views of the raw words
    need it ("bf16" for uint16 bfloat16 bits). A K/V pair codec needs `kv_split` and takes a
    block of keys only or values only (as EXO stores them); NonFiniteError for NaN/Inf."""
    values, dtype = _float_input(src, dtype)
    if isinstance(codec, PairCodec):
        codec = _pair_half(codec, values, kv_split)
    shape = tuple(src.shape)
    n, code = values.size, DTYPE_CODES[dtype]
    words = values.reshape(-1).view(_WORD_TYPES[DTYPE_BYTES[dtype]])
    max_bits = np.uint32(int((words & _ABS_MASKS[code]).max())) if n else np.uint32(0)
    if max_bits >= nonfinite_bits(code):  # an integer reduction: several times a float one's speed
        raise NonFiniteError(f"block of shape {shape} holds NaN/Inf")
    family = FAMILY_OF.get(codec.name)  # None for a K/V pair
    encoder = None if family is None else _ENCODERS.get(family)
    if encoder is None:
        raise ValueError(f"mlx_ops cannot encode with codec {codec.name!r}")
    return encoder(codec, values.reshape(-1), dtype, shape, float(bits_value(max_bits, code)))


def decode(payload: bytes | bytearray | memoryview) -> mx.array:
    """The block in `payload` as an MLX array of its shape and dtype (float16 / bfloat16 /
    float32); PayloadError when the payload is malformed."""
    header, body = checked_body(payload)
    words = _DECODERS[FAMILY_OF[header.codec]](np.frombuffer(body, np.uint8), header)
    return words.reshape(header.shape)


def _new_payload(
    codec: Codec, dtype: str, shape: tuple[int, ...], body_len: int
) -> tuple[bytes, np.ndarray]:
    """A payload of `codec` with its header and a body of `body_len` bytes still to be written."""
    return new_payload(pack_header(codec.name, dtype, shape, codec.group_size, body_len), body_len)


def _words(values: mx.array, header: PayloadHeader) -> mx.array:
    """float32 values clamped to the finite range of the payload's dtype and rounded to it."""
    bound = _MAX_FINITE[header.dtype]
    if bound is not None:
        values = mx.clip(values, -bound, bound)
    return values.astype(_MX_TYPES[header.dtype])


def _sink_decode(host: np.ndarray, header: PayloadHeader) -> mx.array:
    """A sink codec's block: its TurboQuant body decoded, its means added, its sink tokens' raw
    words written."""
    codec = sinks.named_codec(header.codec, header.group_size)
    parts, turbo_body = codec.parts(header, host)
    x = _turbo_decode(turbo_body, codec.turbo, header.shape)
    if parts.means.size:
        x = (x.reshape(parts.blocks) + mx.array(parts.mean_values())).reshape(-1)
    words = _words(x, header)
    if parts.count:
        words = words.reshape(parts.blocks)
        raw = parts.sink_words(DTYPE_BYTES[header.dtype])
        words[:, : parts.count] = mx.array(raw).view(words.dtype)
    return words


def _pair_half(codec: PairCodec, src: mx.array, kv_split: tuple[int, int] | None) -> Codec:
    """The codec of a K/V pair that a block of keys only or values only goes through."""
    if kv_split is not None and -src.ndim <= kv_split[0] < src.ndim:
        count, length = kv_split[1], src.shape[kv_split[0]]
        if count in (0, length):
            return codec.keys if count == length else codec.values
    raise ValueError(
        f"mlx_ops encodes {codec.name} blocks of keys only or values only, got K/V split "
        f"{kv_split} for a block of shape {tuple(src.shape)}"
    )


def _float_input(src: mx.array, dtype: str | None) -> tuple[mx.array, str]:
    """`src` as an MLX float array and its dtype name (integer views reinterpreted)."""
    if not isinstance(src, mx.array):
        raise TypeError(f"mlx_ops encodes an mlx array, got {type(src).__name__}")
    if src.ndim > MAX_NDIM:
        raise ValueError(f"codec input has {src.ndim} dimensions, at most {MAX_NDIM}")
    inferred = _DTYPE_OF.get(src.dtype)
    dtype = dtype or inferred
    if dtype is None:
        raise ValueError(
            f"cannot infer the element type of a {src.dtype} array: pass dtype='fp16', 'bf16' "
            "or 'fp32'"
        )
    if dtype not in _MX_TYPES:
        raise ValueError(f"dtype must be one of {sorted(_MX_TYPES)}, got {dtype!r}")
    if inferred not in (None, dtype) or src.dtype.size != DTYPE_BYTES[dtype]:
        raise ValueError(f"a {src.dtype} array cannot hold {dtype!r} values")
    return (src if inferred else src.view(_MX_TYPES[dtype])), dtype


def _host_bytes(a: mx.array) -> np.ndarray:
    """The bytes of `a` (evaluated) as a flat uint8 numpy array, without a copy where it can."""
    return np.asarray(a.reshape(-1).view(mx.uint8))


# ---- none -----------------------------------------------------------------------------------


def _none_encode(
    codec: Codec, flat: mx.array, dtype: str, shape: tuple[int, ...], max_abs: float
) -> bytes:
    payload, body = _new_payload(codec, dtype, shape, flat.size * DTYPE_BYTES[dtype])
    body[:] = _host_bytes(flat)
    return payload


def _none_decode(host: np.ndarray, header: PayloadHeader) -> mx.array:
    return mx.array(host).view(_MX_TYPES[header.dtype])


# ---- INT8 -----------------------------------------------------------------------------------


def _int8_steps(halves: np.ndarray, k: int) -> np.ndarray:
    """The float32 steps of groups whose stored fp16 scales are `halves` (int8.step_of)."""
    return (halves.astype(np.float64) * 2.0**k).astype(np.float32)


def _per_group(values: mx.array, group_size: int) -> mx.array:
    """A flat array padded with zeros to whole groups, shaped (groups, group_size)."""
    pad = -values.size % group_size
    if pad:
        values = mx.concatenate([values, mx.zeros(pad, values.dtype)])
    return values.reshape(-1, group_size)


def _int8_encode(
    codec: Codec, flat: mx.array, dtype: str, shape: tuple[int, ...], max_abs: float
) -> bytes:
    x, group_size = flat.astype(mx.float32), codec.group_size
    payload, body = _new_payload(codec, dtype, shape, int8.body_bytes(flat.size, group_size))
    n = x.size
    groups = _per_group(x, group_size)
    n_groups = groups.shape[0]
    abs_bits = (groups.view(mx.uint32) & 0x7FFFFFFF).max(axis=1) if n else mx.zeros(0, mx.uint32)
    scales = np.asarray(abs_bits).view(np.float32) / np.float32(127.0)
    k = int(block_exponent(float(scales.max()))) if n else 0
    scaled = (scales.astype(np.float64) * 2.0**-k).astype(np.float32)
    halves = scaled.astype(np.float16)
    too_big = halves.astype(np.float32) > scaled  # round toward zero, as int8.scale_to_half
    halves[too_big] = (halves.view(np.uint16)[too_big] - 1).view(np.float16)
    steps = mx.array(_int8_steps(halves, k))[:, None]
    q = mx.where(steps > 0, mx.round(mx.clip(groups / steps, -127.0, 127.0)), 0.0)
    body[:2] = np.frombuffer(np.int16(k).astype("<i2").tobytes(), np.uint8)
    body[2 : 2 + 2 * n_groups] = halves.astype("<f2").view(np.uint8)
    body[2 + 2 * n_groups :] = _host_bytes(q.reshape(-1)[:n].astype(mx.int8))
    return payload


def _int8_decode(host: np.ndarray, header: PayloadHeader) -> mx.array:
    n, group_size = header.size, header.group_size
    n_groups = -(-n // group_size)
    k = int(host[:2].view("<i2")[0])
    steps = _int8_steps(host[2 : 2 + 2 * n_groups].view("<f2"), k)
    start = 2 + 2 * n_groups
    q = mx.array(host[start : start + n].view(np.int8)).astype(mx.float32)
    return _words((_per_group(q, group_size) * mx.array(steps)[:, None]).reshape(-1)[:n], header)


# ---- TurboQuant -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _rotation_constants(inst: Instance) -> tuple[mx.array, mx.array | None, mx.array, int]:
    """(signs times the Hadamard normalisation, the q x q mix or None, the decision
    boundaries, Hadamard block size p) of one quantizer's rotation y = (Q ⊗ H_p) (signs * u)."""
    rot = inst.rotation
    q = max(1, rot.matrix.shape[0])
    p = inst.m // q
    signs = mx.array(rot.signs * np.float32(1.0 / math.sqrt(p)))
    mix = mx.array(rot.matrix) if q > 1 else None
    return signs, mix, mx.array(inst.codebook.boundaries), p


def _rotate(u: mx.array, inst: Instance) -> mx.array:
    """The rotated coordinates y = (Q ⊗ H_p) (signs * u) of unit vectors u [..., m] (format 2)."""
    signs, mix, _, p = _rotation_constants(inst)
    blocks = mx.hadamard_transform((u * signs).reshape(*u.shape[:-1], -1, p), scale=1.0)
    if mix is not None:
        blocks = mix @ blocks
    return blocks.reshape(u.shape)


def _rotate_back(y: mx.array, inst: Instance) -> mx.array:
    """u = R^T y for rotated coordinates y [..., m]: the Hadamard blocks and the mix transposed,
    or the dense matrix of a format-1 payload."""
    rot = inst.rotation
    if rot.matrix.shape[0] == inst.m:
        return y @ mx.array(rot.matrix)
    signs, mix, _, p = _rotation_constants(inst)
    blocks = y.reshape(*y.shape[:-1], -1, p)
    if mix is not None:
        blocks = mix.T @ blocks
    return mx.hadamard_transform(blocks, scale=1.0).reshape(y.shape) * signs


def _quantize(y: mx.array, boundaries: mx.array) -> mx.array:
    """Per coordinate the number of decision boundaries below it (one comparison with each:
    faster on mlx[cpu] than a binary search of gathers), as uint32."""
    return (y[..., None] > boundaries).sum(axis=-1).astype(mx.uint32)


def _pack(index: mx.array, m: int, bits: int) -> mx.array:
    """Bit-pack the m indices [..., m] of each vector as the kernels do: LSB first, in groups of
    8 (`bits` bytes each; a last partial group padded to a byte), as uint8 [..., bytes]."""
    pad = -m % 8
    if pad:
        index = mx.concatenate([index, mx.zeros((*index.shape[:-1], pad), index.dtype)], axis=-1)
    lanes = index.astype(mx.uint64).reshape(*index.shape[:-1], -1, 8)
    words = (lanes << mx.array(np.arange(8, dtype=np.uint64) * bits)).sum(axis=-1)
    shifts = mx.array(np.arange(bits, dtype=np.uint64) * 8)
    packed = ((words[..., None] >> shifts) & 0xFF).astype(mx.uint8)
    return packed.reshape(*index.shape[:-1], -1)[..., : int(packed_bytes(m, bits))]


def _turbo_encode(
    mode: Codec, flat: mx.array, dtype: str, shape: tuple[int, ...], max_abs: float
) -> bytes:
    x, codec = flat.astype(mx.float32), named_codec(mode.name, mode.group_size)
    codec.check_encodable(np.broadcast_to(np.uint8(0), (x.size,)), shape)  # needs only the size
    payload, body = _new_payload(mode, dtype, shape, codec.layout(shape).body_bytes)
    d = codec.group_size
    layout = codec.layout(shape)
    n = layout.n_vectors
    k = int(block_exponent(max_abs * math.sqrt(d)))
    scaled = x.reshape(-1, layout.sel_mod, layout.sel_div, d) * 2.0**-k
    energy = np.zeros((layout.sel_mod, d))
    if codec.lo is not None and n:  # scaled: float32 squares of |x| up to 3e38 neither overflow
        energy[:] = np.asarray(mx.square(scaled).sum(axis=(0, 2)))  # nor underflow
    channels, masks = codec.channel_map(energy)
    norms, indices = [], []
    for start, inst, _ in codec.instances():
        if inst.m < d:
            chan = mx.array(channels[:, start : start + inst.m])[None, :, None, :]
            v = mx.take_along_axis(scaled, chan, axis=-1)
        else:
            v = scaled
        norm = mx.sqrt(mx.square(v).sum(axis=-1, keepdims=True))
        u = v * mx.where(norm > 0, 1.0 / norm, 0.0)
        _, _, boundaries, _ = _rotation_constants(inst)
        norms.append(norm)
        indices.append(_pack(_quantize(_rotate(u, inst), boundaries), inst.m, inst.bits))
    body[:2] = np.frombuffer(np.int16(k).astype("<i2").tobytes(), np.uint8)
    body[2 : layout.norms_offset] = masks.reshape(-1)
    body[layout.norms_offset : layout.indices_offset] = _host_bytes(
        mx.concatenate(norms, axis=-1).astype(mx.float16)
    )
    body[layout.indices_offset :] = _host_bytes(mx.concatenate(indices, axis=-1))
    return payload


def _turbo_payload_decode(host: np.ndarray, header: PayloadHeader) -> mx.array:
    codec = named_codec(header.codec, header.group_size, header.version)
    return _words(_turbo_decode(host, codec, header.shape), header)


def _turbo_decode(host: np.ndarray, codec: TurboCodec, shape: tuple[int, ...]) -> mx.array:
    """The values of a TurboQuant body."""
    layout = codec.layout(shape)
    k = int(host[:2].view("<i2")[0])
    channels = codec.body_channels(host, layout)
    n = layout.n_vectors
    norms_end = layout.norms_offset + 2 * layout.n_instances * n
    norms = mx.array(host[layout.norms_offset : norms_end].copy().view("<f2"))
    norms = norms.astype(mx.float32).reshape(-1, layout.sel_mod, layout.sel_div, layout.n_instances)
    indices = mx.array(host[norms_end:]).astype(mx.uint32).reshape(n, layout.bytes_per_vector)
    indices = mx.concatenate([indices, mx.zeros((n, 1), mx.uint32)], axis=1)
    indices = indices.reshape(-1, layout.sel_mod, layout.sel_div, layout.bytes_per_vector + 1)
    parts = []  # per instance: [outer, groups, div, m] in the instance's channel order
    for i, (_, inst, byte_at) in enumerate(codec.instances()):
        offset, shift = index_positions(inst.m, inst.bits)
        at = mx.array(offset + byte_at)
        low, high = mx.take(indices, at, axis=-1), mx.take(indices, at + 1, axis=-1)
        idx = ((low | (high << 8)) >> mx.array(shift.astype(np.uint32))) & ((1 << inst.bits) - 1)
        levels = mx.take(mx.array(inst.codebook.centroids), idx.astype(mx.int32))
        parts.append(_rotate_back(levels, inst) * norms[..., i : i + 1])
    ordered = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    inverse = np.argsort(channels, axis=1).astype(np.int32)  # channel c sits at inverse[s, c]
    x = mx.take_along_axis(ordered, mx.array(inverse)[None, :, None, :], axis=-1)
    return (x * 2.0**k).reshape(-1)


_Encoder = Callable[[Codec, mx.array, str, tuple[int, ...], float], bytes]
_ENCODERS: dict[CodecFamily, _Encoder] = {
    lossless.FAMILY: _none_encode,
    int8.FAMILY: _int8_encode,
    turbo.FAMILY: _turbo_encode,
}
"""Each family's encode: (codec, the block's finite values flat, dtype, shape, their largest
magnitude) -> the payload; the key-aware codecs have none here."""
_DECODERS: dict[CodecFamily, Callable[[np.ndarray, PayloadHeader], mx.array]] = {
    lossless.FAMILY: _none_decode,
    int8.FAMILY: _int8_decode,
    turbo.FAMILY: _turbo_payload_decode,
    sinks.FAMILY: _sink_decode,
}
"""Each family's decode: (the body, header) -> the block's values, flat or of its shape, in the
payload's dtype."""
