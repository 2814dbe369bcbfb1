"""The codecs on torch tensors (GPU or CPU): the same payloads as the Numba kernels.

A restore on a GPU machine can copy the compressed body over PCIe and decode there. INT8 is bit
for bit the Numba result (the same float32 operations in the same order); TurboQuant rotates
with a dense matrix instead of the Walsh–Hadamard butterflies, so it matches within float32
rounding (an index can flip where a coordinate sits on a decision boundary).
Only this module and torch_batch (the batched decode) of tierkv.quant import torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from tierkv.codecs import DTYPE_BYTES, FRAMEWORK_DTYPES
from tierkv.quant import int8, lossless, sinks, turbo
from tierkv.quant.base import Codec, CodecFamily
from tierkv.quant.codec import FAMILY_OF, checked_body
from tierkv.quant.kernels import block_exponent
from tierkv.quant.payload import NonFiniteError, PayloadError, PayloadHeader, pack_header
from tierkv.quant.turbo import (
    Layout,
    TurboCodec,
    index_positions,
    named_codec,
)

_DTYPE_OF = {getattr(torch, name): ours for name, ours in FRAMEWORK_DTYPES.items()}
_FLOAT_TYPES = {ours: torch_type for torch_type, ours in _DTYPE_OF.items()}
_MAX_FINITE = {name: torch.finfo(t).max for name, t in _FLOAT_TYPES.items()}


def decode_into(payload: bytes | bytearray | memoryview, out: torch.Tensor) -> None:
    """Decode `payload` into the contiguous tensor `out` (on any device).

    `out` holds the payload's dtype (float16 / bfloat16 / float32, or a same-size integer view
    of the raw words) and element count; otherwise PayloadError."""
    header, body = checked_body(payload)
    _check_output(out, header)
    raw = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(out.device)
    words = _DECODERS[FAMILY_OF[header.codec]](raw, header, body)
    out.view(-1).copy_(words.view(out.dtype))


def encode(codec: Codec, src: torch.Tensor, dtype: str | None = None) -> bytes:
    """The payload `codec.encode` makes for the same values, computed with torch on src.device.

    dtype is inferred from float16 / bfloat16 / float32 tensors; 16-bit integer views of raw
    words need dtype="fp16" or "bf16"."""
    dtype = _dtype_of(src, dtype)
    shape = tuple(src.shape)
    flat = src.contiguous().view(-1)
    if flat.dtype not in _DTYPE_OF:
        flat = flat.view(_FLOAT_TYPES[dtype])
    family = FAMILY_OF.get(codec.name)  # None for a K/V pair
    encoder = None if family is None else _ENCODERS.get(family)
    if encoder is None:
        raise ValueError(f"torch_ops cannot encode with codec {codec.name!r}")
    if not bool(torch.isfinite(flat).all()):
        raise NonFiniteError(f"block of shape {shape} holds NaN/Inf")
    body = encoder(flat, codec, shape)
    header = pack_header(codec.name, dtype, shape, codec.group_size, body.numel())
    return header + body.cpu().numpy().tobytes()


def _dtype_of(src: torch.Tensor, dtype: str | None) -> str:
    if dtype is None:
        if src.dtype not in _DTYPE_OF:
            raise ValueError(
                f"cannot infer the element type of a {src.dtype} tensor: pass dtype='fp16', "
                "'bf16' or 'fp32'"
            )
        return _DTYPE_OF[src.dtype]
    if dtype not in DTYPE_BYTES or src.element_size() != DTYPE_BYTES[dtype]:
        raise ValueError(f"dtype {dtype!r} does not fit a {src.dtype} tensor")
    return dtype


def _check_output(out: torch.Tensor, header: PayloadHeader) -> None:
    if out.element_size() != DTYPE_BYTES[header.dtype]:
        raise PayloadError(f"output tensor is {out.dtype} but the payload holds {header.dtype}")
    if out.dtype.is_floating_point and out.dtype != _FLOAT_TYPES[header.dtype]:
        raise PayloadError(f"output tensor is {out.dtype} but the payload holds {header.dtype}")
    if out.numel() != header.size:
        raise PayloadError(
            f"output tensor has {out.numel()} elements (shape {tuple(out.shape)}) but the "
            f"payload holds {header.size} (shape {header.shape})"
        )
    if not out.is_contiguous():
        raise PayloadError("output tensor must be contiguous")


def _words(decoded: torch.Tensor, header: PayloadHeader) -> torch.Tensor:
    """float32 values clamped to the finite range of the payload's dtype and rounded to it."""
    bound = _MAX_FINITE[header.dtype]
    return decoded.clamp_(-bound, bound).to(_FLOAT_TYPES[header.dtype])


# ---- none -----------------------------------------------------------------------------------


def _none_decode(raw: torch.Tensor, header: PayloadHeader, body: memoryview) -> torch.Tensor:
    return raw.view(_FLOAT_TYPES[header.dtype])


def _none_encode(flat: torch.Tensor, codec: Codec, shape: tuple[int, ...]) -> torch.Tensor:
    return flat.view(torch.uint8)


# ---- INT8 -----------------------------------------------------------------------------------


def _per_group(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Pad a flat tensor with zeros to whole groups, shaped (groups, group_size)."""
    pad = -values.numel() % group_size
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    return values.view(-1, group_size)


def _int8_steps(scales16: torch.Tensor, k: int) -> torch.Tensor:
    return (scales16.double() * 2.0**k).float()


def _int8_encode(flat: torch.Tensor, codec: Codec, shape: tuple[int, ...]) -> torch.Tensor:
    x, group_size = flat.float(), codec.group_size
    n = x.numel()
    groups = _per_group(x, group_size)
    scales = groups.abs().amax(dim=1) / 127.0 if n else groups.new_zeros(0)
    k = int(block_exponent(float(scales.max()))) if n else 0
    scaled = (scales.double() * 2.0**-k).float()
    halves = scaled.half()
    too_big = halves.float() > scaled  # round the scale toward zero, as the kernel does
    halves = torch.where(too_big, (halves.view(torch.int16) - 1).view(torch.float16), halves)
    steps = _int8_steps(halves, k)
    q = torch.where(
        steps[:, None] > 0,
        (groups / steps[:, None].clamp_min(torch.finfo(torch.float32).tiny))
        .clamp(-127.0, 127.0)
        .round(),
        0.0,
    )
    head = torch.tensor([k], dtype=torch.int16, device=x.device).view(torch.uint8)
    body = [head, halves.view(torch.uint8), q.view(-1)[:n].to(torch.int8).view(torch.uint8)]
    return torch.cat(body)


def _int8_decode(raw: torch.Tensor, header: PayloadHeader, body: memoryview) -> torch.Tensor:
    n, group_size = header.size, header.group_size
    n_groups = -(-n // group_size)
    k = int(raw[:2].view(torch.int16).item())
    steps = _int8_steps(raw[2 : 2 + 2 * n_groups].view(torch.float16), k)
    start = 2 + 2 * n_groups
    q = raw[start : start + n].view(torch.int8).float()
    return _words((_per_group(q, group_size) * steps[:, None]).view(-1)[:n], header)


# ---- TurboQuant -----------------------------------------------------------------------------


def _by_group(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A per-vector tensor [n_vectors, ...] viewed as [outer, group, div, ...]: vector v belongs
    to channel-selection group (v // div) % groups (see turbo.selection_groups)."""
    groups, div = layout.sel_mod, layout.sel_div
    return t.view(-1, groups, div, *t.shape[1:])


def _turbo_encode(flat: torch.Tensor, mode: Codec, shape: tuple[int, ...]) -> torch.Tensor:
    x, codec = flat.float(), named_codec(mode.name, mode.group_size)
    d, device = codec.group_size, x.device
    if x.numel() % d:
        raise ValueError(
            f"{codec.name} encodes whole vectors of group_size={d} values; the block of shape "
            f"{shape} has {x.numel()} values"
        )
    layout = codec.layout(shape)
    vectors = x.view(-1, d)
    k = int(block_exponent(float(vectors.abs().max()) * math.sqrt(d))) if x.numel() else 0
    grouped = _by_group(vectors, layout)
    energy = np.zeros((layout.sel_mod, d))
    if codec.lo is not None:
        for s in range(layout.sel_mod):
            energy[s] = grouped[:, s].double().square().sum(dim=(0, 1)).cpu().numpy()
    channels, masks = codec.channel_map(energy)
    scaled = _by_group(vectors * 2.0**-k, layout)
    norms = torch.empty((layout.n_vectors, layout.n_instances), device=device)
    packed = torch.zeros(
        (layout.n_vectors, layout.bytes_per_vector + 1), dtype=torch.int32, device=device
    )
    for i, (start, inst, byte_at) in enumerate(codec.instances()):
        rot = torch.from_numpy(inst.rotation.as_matrix().astype(np.float32)).to(device)
        bounds = torch.from_numpy(inst.codebook.boundaries).to(device)
        offset, shift = index_positions(inst.m, inst.bits)
        at = torch.from_numpy(offset + byte_at).to(device)
        shifts = torch.from_numpy(shift).to(device=device, dtype=torch.int32)
        for s in range(layout.sel_mod):
            chan = torch.from_numpy(channels[s, start : start + inst.m].astype(np.int64))
            v = scaled[:, s][..., chan.to(device)].reshape(-1, inst.m)
            norm = v.square().sum(dim=1).sqrt()
            _by_group(norms, layout)[:, s, :, i] = norm.view(-1, layout.sel_div)
            inv = torch.where(norm > 0, 1.0 / norm, torch.zeros_like(norm))
            idx = torch.bucketize((v * inv[:, None]) @ rot.T, bounds).to(torch.int32) << shifts
            idx = idx.view(-1, layout.sel_div, inst.m)
            target = _by_group(packed, layout)[:, s]
            target.index_add_(2, at, idx & 0xFF)
            target.index_add_(2, at + 1, idx >> 8)
    head = torch.tensor([k], dtype=torch.int16, device=device).view(torch.uint8)
    parts = [head]
    if codec.lo is not None:
        parts.append(torch.from_numpy(masks.reshape(-1)).to(device))
    parts.append(norms.half().view(-1).view(torch.uint8))
    parts.append(packed[:, :-1].to(torch.uint8).reshape(-1))
    return torch.cat(parts)


def _turbo_payload_decode(
    raw: torch.Tensor, header: PayloadHeader, body: memoryview
) -> torch.Tensor:
    codec = named_codec(header.codec, header.group_size, header.version)
    return _words(_turbo_decode(raw, codec, header.shape, np.frombuffer(body, np.uint8)), header)


def _sink_decode(raw: torch.Tensor, header: PayloadHeader, body: memoryview) -> torch.Tensor:
    """A sink codec's block: its TurboQuant body decoded, its means added, its sink tokens'
    raw words written."""
    codec = sinks.named_codec(header.codec, header.group_size)
    host = np.frombuffer(body, np.uint8)
    parts, turbo_body = codec.parts(header, host)
    start = len(host) - len(turbo_body)
    x = _turbo_decode(raw[start:], codec.turbo, header.shape, turbo_body)
    if parts.means.size:
        means = torch.from_numpy(parts.mean_values()).to(raw.device)
        x = (x.view(parts.blocks) + means).view(-1)
    words = _words(x, header)
    if parts.count:
        raw_words = torch.from_numpy(parts.sink_words(DTYPE_BYTES[header.dtype]).copy())
        words.view(parts.blocks)[:, : parts.count] = raw_words.to(words.device).view(words.dtype)
    return words


def _turbo_decode(
    raw: torch.Tensor, codec: TurboCodec, shape: tuple[int, ...], host: np.ndarray
) -> torch.Tensor:
    """The values of a TurboQuant body (`raw` on the device, `host` the same bytes)."""
    d, device = codec.group_size, raw.device
    layout = codec.layout(shape)
    k = int(host[:2].view("<i2")[0])
    channels = codec.body_channels(host, layout)
    n = layout.n_vectors
    norms_end = layout.norms_offset + 2 * layout.n_instances * n
    # clone: the norms may start at an odd byte offset, which a float16 view cannot
    norms = raw[layout.norms_offset : norms_end].clone().view(torch.float16).float()
    norms = _by_group(norms.view(n, layout.n_instances), layout)
    indices = raw[norms_end:].view(n, layout.bytes_per_vector).to(torch.int32)
    indices = _by_group(torch.cat([indices, indices.new_zeros((n, 1))], dim=1), layout)
    x = torch.empty((n, d), device=device)
    grouped = _by_group(x, layout)
    for i, (start, inst, byte_at) in enumerate(codec.instances()):
        offset, shift = index_positions(inst.m, inst.bits)
        at = torch.from_numpy(offset + byte_at).to(device)
        shifts = torch.from_numpy(shift).to(device=device, dtype=torch.int32)
        centroids = torch.from_numpy(inst.codebook.centroids).to(device)
        rot = torch.from_numpy(inst.rotation.as_matrix().astype(np.float32)).to(device)
        for s in range(layout.sel_mod):
            rows = indices[:, s]
            idx = ((rows[..., at] | (rows[..., at + 1] << 8)) >> shifts) & ((1 << inst.bits) - 1)
            u = centroids[idx.long()] @ rot
            chan = torch.from_numpy(channels[s, start : start + inst.m].astype(np.int64))
            grouped[:, s, :, chan.to(device)] = u * norms[:, s, :, i : i + 1]
    return (x * 2.0**k).view(-1)


_Decoder = Callable[[torch.Tensor, PayloadHeader, memoryview], torch.Tensor]
_DECODERS: dict[CodecFamily, _Decoder] = {
    lossless.FAMILY: _none_decode,
    int8.FAMILY: _int8_decode,
    turbo.FAMILY: _turbo_payload_decode,
    sinks.FAMILY: _sink_decode,
}
"""Each family's decode: (the body on the output's device, header, the body on the host) ->
the block's words, flat, in the payload's dtype."""
_Encoder = Callable[[torch.Tensor, Codec, tuple[int, ...]], torch.Tensor]
_ENCODERS: dict[CodecFamily, _Encoder] = {
    lossless.FAMILY: _none_encode,
    int8.FAMILY: _int8_encode,
    turbo.FAMILY: _turbo_encode,
}
"""Each family's encode: (the block's finite values, flat, in its dtype, codec, shape) -> the
payload body; the key-aware codecs have none here."""
