"""Decode payloads with MLX, where EXO's KV lives (the GPU on Apple Silicon): the same payloads as
the Numba kernels.

INT8 is bit for bit the Numba result (the same float32 operations; the per-group steps are
computed on the host in float64 as the kernel does). TurboQuant rotates back with a dense matrix
instead of the Walsh–Hadamard butterflies, so it matches within float32 rounding. Tested with
mlx[cpu]; Metal is untested. Only this module of tierkv.quant imports MLX.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from tierkv.quant.codec import checked_body
from tierkv.quant.payload import PayloadHeader
from tierkv.quant.turbo import index_positions, named_codec

_MX_TYPES = {"fp16": mx.float16, "bf16": mx.bfloat16, "fp32": mx.float32}
_MAX_FINITE = {"fp16": 65504.0, "bf16": float(np.uint32(0x7F7F0000).view(np.float32)), "fp32": None}


def decode(payload: bytes | bytearray | memoryview) -> mx.array:
    """The block in `payload` as an MLX array of its shape and dtype (float16 / bfloat16 /
    float32); PayloadError when the payload is malformed."""
    header, body = checked_body(payload)
    host = np.frombuffer(body, np.uint8)
    target = _MX_TYPES[header.dtype]
    if header.codec == "none":
        return mx.array(host).view(target).reshape(header.shape)
    decoder = _int8_decode if header.codec == "int8" else _turbo_decode
    values = decoder(host, header)
    bound = _MAX_FINITE[header.dtype]
    if bound is not None:
        values = mx.clip(values, -bound, bound)
    return values.astype(target).reshape(header.shape)


def _int8_decode(host: np.ndarray, header: PayloadHeader) -> mx.array:
    n, group_size = header.size, header.group_size
    n_groups = -(-n // group_size)
    k = int(host[:2].view("<i2")[0])
    halves = host[2 : 2 + 2 * n_groups].view("<f2")
    steps = (halves.astype(np.float64) * 2.0**k).astype(np.float32)
    start = 2 + 2 * n_groups
    q = mx.array(host[start : start + n].view(np.int8)).astype(mx.float32)
    pad = -n % group_size
    if pad:
        q = mx.concatenate([q, mx.zeros(pad, mx.float32)])
    return (q.reshape(n_groups, group_size) * mx.array(steps)[:, None]).reshape(-1)[:n]


def _turbo_decode(host: np.ndarray, header: PayloadHeader) -> mx.array:
    codec = named_codec(header.codec, header.group_size, header.version)
    layout = codec.layout(header.shape)
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
        rotation = mx.array(inst.rotation.as_matrix().astype(np.float32))
        parts.append((levels @ rotation) * norms[..., i : i + 1])
    ordered = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    inverse = np.argsort(channels, axis=1).astype(np.int32)  # channel c sits at inverse[s, c]
    x = mx.take_along_axis(ordered, mx.array(inverse)[None, :, None, :], axis=-1)
    return (x * 2.0**k).reshape(-1)
