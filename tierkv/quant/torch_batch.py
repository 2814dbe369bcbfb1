"""One batched torch decode of many payloads: bit for bit the Numba decode, on any torch device.

A restore's payloads are copied as they arrive into one host buffer (`Received`: pinned when the
decode runs on CUDA); `decode_batch` then copies that buffer to the device once, groups the
payloads by header (codec, dtype, shape, and a key-aware body's prefix), and decodes each group
with a fixed number of vectorised torch operations over all its payloads, whatever their count:
none is a view, INT8 a multiply per group of values, TurboQuant a table look-up of its packed
indices, its Walsh-Hadamard butterflies stage by stage (and the mix of its Hadamard blocks),
its scaling and the conversion, with each payload's channel order, means and sink tokens. A K/V
pair payload is its two halves, each decoded with the halves of the other pair payloads.

Every float32 operation is the Numba kernel's, in its order (tierkv.quant.turbo: the look-up
tables with their first butterfly stages, `0 + c * y` for the mix, `value * factor * norm *
2**k` left to right, the clamp, rounding to nearest even), so the words are the same bits. The
dense rotations of format version 1 (reassociated dot products in Numba) are not batched: such a
payload is reported as not handled, for the caller's per-payload decode.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tierkv.codecs import SINK_MODES, TURBO_MODES
from tierkv.quant import sinks
from tierkv.quant.codec import checked_body
from tierkv.quant.pair import is_pair, parse_pair
from tierkv.quant.payload import PayloadError, PayloadHeader, parse_header
from tierkv.quant.turbo import Instance, TurboCodec, index_positions, named_codec

_FLOAT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_MAX_FINITE = {name: torch.finfo(t).max for name, t in _FLOAT.items()}


class Received:
    """The payloads of one batch of `capacity` blocks in one host buffer (pinned when `pin`):
    payload i at row i of [capacity, stride] bytes. The stride is the first payload's length and
    a quarter more (a restore's payloads of one codec are about as long: the larger first block
    of a key-aware codec, with its sink tokens, fits), so each group of equal payloads is one
    indexed row copy, and the device copy about the bytes received."""

    def __init__(self, capacity: int, *, pin: bool) -> None:
        self.capacity = capacity
        self._pin = pin
        self._lock = threading.Lock()
        self.data = torch.empty(0, dtype=torch.uint8)
        self.stride = 0
        self.lengths: dict[int, int] = {}
        """Payload length of each index added."""

    def add(self, index: int, payload: bytes | bytearray | memoryview) -> bool:
        """Copy payload `index` in; False when it does not fit (the caller decodes it itself)."""
        view = memoryview(payload).cast("B")
        with self._lock:  # payloads arrive on several receive threads
            if not self.stride:
                stride = -(-(len(view) * 5 // 4 + 64) // 64) * 64
                self.data = torch.empty(
                    self.capacity * stride, dtype=torch.uint8, pin_memory=self._pin
                )
                self.stride = stride
        if len(view) > self.stride or not 0 <= index < self.capacity:
            return False
        at = index * self.stride
        self.data.numpy()[at : at + len(view)] = np.frombuffer(view, np.uint8)
        self.lengths[index] = len(view)
        return True

    def payload(self, index: int) -> memoryview:
        """The bytes of payload `index`."""
        at = index * self.stride
        return memoryview(self.data.numpy()[at : at + self.lengths[index]].data)


@dataclass(frozen=True)
class _Key:
    """What a group of payloads shares: the header, a key-aware body's prefix and body length
    (equal keys: equal offsets everywhere in the body), and where in the block it goes."""

    header: PayloadHeader
    prefix: bytes
    body_bytes: int
    half: tuple[tuple[int, int, int], int] | None  # (axis, start, stop), block ndim; None: all


def decode_batch(received: Received, out: torch.Tensor) -> tuple[set[int], set[int]]:
    """Decode the payloads of `received` into out[index] (out: [n, *block] on any device, the
    block's dtype, contiguous). Returns (failed indices, indices not handled: decode those one
    by one). Runs on the current stream; one host-to-device copy of the whole buffer."""
    failed: set[int] = set()
    groups: dict[_Key, list[tuple[int, int, int]]] = defaultdict(list)  # index, start, stop
    if not received.lengths:
        return failed, set()
    host = received.data.numpy().reshape(received.capacity, received.stride)
    unhandled: set[int] = set()
    for index, length in received.lengths.items():
        try:
            for key, at, to in _pieces(host[index, :length], out.shape[1:], out.dtype):
                groups[key].append((index, at, to))
        except _NotBatched:
            unhandled.add(index)
        except PayloadError:
            failed.add(index)
    rows = received.data.view(received.capacity, received.stride)
    data = rows.to(out.device, non_blocking=True)
    for key, members in groups.items():
        members = [m for m in members if m[0] not in failed and m[0] not in unhandled]
        if not members:
            continue
        try:
            bad = _decode_group(key, members, host, data, out)
        except _NotBatched:
            unhandled.update(index for index, _, _ in members)
            continue
        failed.update(bad)
    return failed, unhandled - failed


class _NotBatched(Exception):
    """A payload the batched decode does not handle (format version 1's dense rotations)."""


def _pieces(
    payload: np.ndarray, block: Sequence[int], dtype: torch.dtype
) -> list[tuple[_Key, int, int]]:
    """The groups payload bytes belong to: (key, start, stop of the inner payload); two for a
    K/V pair. PayloadError when it does not fit the block."""
    view = memoryview(payload.data)
    if is_pair(view):
        header, keys, values = parse_pair(view)
        if header.shape != tuple(block):
            raise PayloadError(f"K/V pair of shape {header.shape} does not fit {tuple(block)}")
        pieces = []
        offset = len(view) - len(keys) - len(values)
        for inner, (start, stop) in (
            (keys, (0, header.keys_count)),
            (values, (header.keys_count, header.shape[header.axis])),
        ):
            inner_header = parse_header(inner)[0]
            half = list(header.shape)
            half[header.axis] = stop - start
            codec = header.keys if start == 0 else header.values
            expected = (codec, header.dtype, tuple(half))
            if (inner_header.codec, inner_header.dtype, inner_header.shape) != expected:
                raise PayloadError("K/V pair half does not fit its header")
            where = ((header.axis, start, stop), len(header.shape))
            (key, _, _), *_ = _pieces_of(inner, half, dtype, where)
            pieces.append((key, offset, offset + len(inner)))
            offset += len(inner)
        return pieces
    return _pieces_of(view, list(block), dtype, None)


def _pieces_of(
    view: memoryview,
    block: Sequence[int],
    dtype: torch.dtype,
    half: tuple[tuple[int, int, int], int] | None,
) -> list[tuple[_Key, int, int]]:
    header, body = checked_body(view)
    if header.size != math.prod(block) or _FLOAT[header.dtype].itemsize != dtype.itemsize:
        raise PayloadError(
            f"{header.codec} payload of shape {header.shape} {header.dtype} does not fit a block "
            f"of shape {tuple(block)} {dtype}"
        )
    prefix = b""
    if header.codec in SINK_MODES:
        prefix = bytes(body[: sinks.PREFIX.size])
        sinks.named_codec(header.codec, header.group_size).parts(header, np.asarray(body))
    elif header.codec in TURBO_MODES:
        codec = named_codec(header.codec, header.group_size, header.version)
        if any(_dense(inst) for _, inst, _ in codec.instances()):
            raise _NotBatched
    return [(_Key(header, prefix, len(body), half), 0, len(view))]


def _dense(inst: Instance) -> bool:
    return inst.rotation.matrix.shape[0] == inst.m


def _decode_group(
    key: _Key,
    members: list[tuple[int, int, int]],
    host: np.ndarray,
    data: torch.Tensor,
    out: torch.Tensor,
) -> set[int]:
    """Decode one group into its slots of `out`; the indices that failed (corrupt masks)."""
    header = key.header
    body = members[0][2] - key.body_bytes  # the same offset in every member's payload
    slots = np.asarray([index for index, _, _ in members], dtype=np.int64)
    host_bodies = host[slots, body : body + key.body_bytes]
    if data.device.type == "cpu":  # numpy's row copy (torch's index_select: ~10x slower)
        bodies = torch.from_numpy(host_bodies)
    else:
        bodies = data.index_select(0, torch.from_numpy(slots).to(data.device))
        bodies = bodies[:, body : body + key.body_bytes]
    ok = np.ones(len(members), bool)
    if header.codec == "none":
        words = bodies.view(_FLOAT[header.dtype])
    elif header.codec == "int8":
        words = _int8(bodies, host_bodies, header)
    elif header.codec in SINK_MODES:
        words, ok = _sinks(bodies, host_bodies, header, key.prefix)
    else:
        codec = named_codec(header.codec, header.group_size, header.version)
        words, ok = _turbo(bodies, host_bodies, codec, header, None)
    good_slots = torch.from_numpy(slots[ok]).to(out.device)
    if not ok.all():
        words = words[torch.from_numpy(np.flatnonzero(ok)).to(words.device)]
    values = words.reshape(len(good_slots), *header.shape).view(out.dtype)
    target = out
    if key.half is not None:
        (axis, first, last), _ = key.half
        target = out.narrow(axis + 1, first, last - first)
    _write_rows(target, good_slots, values.reshape(len(good_slots), *target.shape[1:]))
    return {index for (index, _, _), good in zip(members, ok, strict=True) if not good}


def _write_rows(target: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """target[slots[i]] = values[i]: one index_copy_ on a device; on the CPU numpy's fancy
    indexing (torch's index_copy_ of 16-bit words measured an order of magnitude slower)."""
    if target.device.type != "cpu":
        target.index_copy_(0, slots, values)
        return
    as_int = {2: torch.int16, 4: torch.int32}[target.element_size()]
    target.view(as_int).numpy()[slots.numpy()] = values.view(as_int).numpy()


def _pow2k(host_bodies: np.ndarray, device: torch.device) -> torch.Tensor:
    """Each body's 2**k (the int16 at its start) as float64 [G, 1]."""
    k = host_bodies[:, :2].copy().view("<i2")[:, 0].astype(np.float64)
    return torch.from_numpy(np.ldexp(1.0, k.astype(np.int64))[:, None]).to(device)


def _words(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """float32 values clamped to the finite range of `dtype` and rounded to it."""
    bound = _MAX_FINITE[dtype]
    return x.clamp_(-bound, bound).to(_FLOAT[dtype])


def _int8(bodies: torch.Tensor, host_bodies: np.ndarray, header: PayloadHeader) -> torch.Tensor:
    n, group = header.size, header.group_size
    n_groups = -(-n // group)
    scales = (
        bodies[:, 2 : 2 + 2 * n_groups]
        .clone(memory_format=torch.contiguous_format)
        .view(torch.float16)
    )
    steps = (scales.double() * _pow2k(host_bodies, bodies.device)).float()
    start = 2 + 2 * n_groups
    q = (
        bodies[:, start : start + n]
        .clone(memory_format=torch.contiguous_format)
        .view(torch.int8)
        .float()
    )
    pad = n_groups * group - n
    if pad:
        q = torch.cat([q, q.new_zeros((len(q), pad))], dim=1)
    x = (q.view(len(q), n_groups, group) * steps[:, :, None]).view(len(q), -1)[:, :n]
    return _words(x, header.dtype)


def _sinks(
    bodies: torch.Tensor, host_bodies: np.ndarray, header: PayloadHeader, prefix: bytes
) -> tuple[torch.Tensor, np.ndarray]:
    codec = sinks.named_codec(header.codec, header.group_size)
    parts, _ = codec.parts(header, host_bodies[0])
    outer, tokens, inner = parts.blocks
    means_end = sinks.PREFIX.size + len(parts.means)
    head = means_end + len(parts.raw)
    centre = None
    if len(parts.means):
        means = (
            bodies[:, sinks.PREFIX.size : means_end]
            .clone(memory_format=torch.contiguous_format)
            .view(torch.float16)
            .float()
        )
        centre = (
            means.view(len(bodies), -1, header.group_size),
            inner // header.group_size,
            tokens,
        )
    words, ok = _turbo(bodies[:, head:], host_bodies[:, head:], codec.turbo, header, centre)
    if parts.count:
        target = _FLOAT[header.dtype]
        raw = bodies[:, means_end:head].clone(memory_format=torch.contiguous_format).view(target)
        view = words.view(len(bodies), outer, tokens, inner)
        view[:, :, : parts.count] = raw.view(len(bodies), outer, parts.count, inner)
    return words, ok


def _turbo(
    bodies: torch.Tensor,
    host_bodies: np.ndarray,
    codec: TurboCodec,
    header: PayloadHeader,
    centre: tuple[torch.Tensor, int, int] | None,
) -> tuple[torch.Tensor, np.ndarray]:
    """Words [G, values] of TurboQuant bodies, and which bodies' channel masks are valid."""
    d, device, g = codec.group_size, bodies.device, len(bodies)
    layout = codec.layout(header.shape)
    n = layout.n_vectors
    ok = np.ones(g, bool)
    channels = None
    if codec.lo is not None:
        masks = host_bodies[:, 2 : layout.norms_offset].reshape(g, layout.sel_mod, -1)
        bits = np.unpackbits(masks, axis=2, bitorder="little")[:, :, :d]
        ok = (bits.sum(axis=2) == codec.hi.m).all(axis=1)
        order = torch.from_numpy(bits).to(device).argsort(dim=2, descending=True, stable=True)
        sel = (torch.arange(n, device=device) // layout.sel_div) % layout.sel_mod
        channels = order[:, sel]  # [G, n, d]: vector v's channel of its word j
    norms_end = layout.norms_offset + 2 * layout.n_instances * n
    norms = (
        bodies[:, layout.norms_offset : norms_end]
        .clone(memory_format=torch.contiguous_format)
        .view(torch.float16)
        .float()
    )
    norms = norms.view(g, n, layout.n_instances)
    indices = bodies[:, norms_end:].reshape(g, n, layout.bytes_per_vector)
    pow2k = _pow2k(host_bodies, device).float()[:, :, None]  # [G, 1, 1]
    rows = _mean_rows(centre, n, device)
    words = torch.empty((g, n, d), dtype=_FLOAT[header.dtype], device=device)
    for i, (start, inst, byte_at) in enumerate(codec.instances()):
        x = _levels(indices, inst, byte_at)
        x = x * _factors(inst, device) * norms[:, :, i : i + 1] * pow2k
        if centre is not None and rows is not None:
            x = x + centre[0][:, rows]
        words[:, :, start : start + inst.m] = _words(x, header.dtype)
    if channels is not None:
        merged = torch.empty_like(words)
        merged.scatter_(2, channels, words)
        words = merged
    return words.view(g, -1), ok


def _mean_rows(
    centre: tuple[torch.Tensor, int, int] | None, n: int, device: torch.device
) -> torch.Tensor | None:
    """Vector v's row of a centred codec's means: (v // (iv * tokens)) * iv + v % iv."""
    if centre is None:
        return None
    _, iv, tokens = centre
    v = torch.arange(n, device=device)
    return (v // (iv * tokens)) * iv + v % iv


def _levels(packed: torch.Tensor, inst: Instance, byte_at: int) -> torch.Tensor:
    """One instance's values of every vector, rotated back up to its scale factors: the
    look-up table's levels (with its first butterfly stages), the mix of Hadamard blocks, the
    remaining butterflies. `packed`: [G, n, bytes per vector] uint8; [G, n, m] float32."""
    device = packed.device
    table, offset, shift, mix = _tables(inst, str(device))
    per_entry = table.shape[1]
    if inst.bits * per_entry == 8 and inst.m % 8 == 0:  # a table entry is a whole byte
        codes = packed[..., byte_at : byte_at + inst.m // per_entry].long()
    else:
        indices = torch.cat([packed, packed.new_zeros((*packed.shape[:-1], 1))], dim=-1)
        indices = indices.to(torch.int32)
        at = torch.from_numpy(offset + byte_at).to(device)
        idx = ((indices[..., at] | (indices[..., at + 1] << 8)) >> shift) & ((1 << inst.bits) - 1)
        codes = idx[..., 0::per_entry]
        for e in range(1, per_entry):
            codes = codes | (idx[..., e::per_entry] << (inst.bits * e))
        codes = codes.long()
    y = table.index_select(0, codes.reshape(-1)).view(*codes.shape[:-1], inst.m)  # [G, n, m]
    if mix is None:
        return _butterflies(y, per_entry)
    q = mix.shape[0]
    p = inst.m // q
    blocks = y.view(*y.shape[:-1], q, p)
    z = torch.empty_like(blocks)
    zero = torch.zeros((), device=device)
    for a in range(q):
        acc = zero + mix[a, 0] * blocks[..., 0, :]
        for b in range(1, q):
            acc = acc + mix[a, b] * blocks[..., b, :]
        z[..., a, :] = acc
    return _butterflies(z, 1).flatten(-2)


def _butterflies(y: torch.Tensor, first: int) -> torch.Tensor:
    """The Walsh-Hadamard stages of distance first .. size / 2 on the last axis: each pair
    (a, b) becomes (a + b, a - b), stage by stage (the kernel's order, so the same bits)."""
    size = y.shape[-1]
    h = first
    while h < size:
        pairs = y.reshape(*y.shape[:-1], size // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(y.shape)
        h *= 2
    return y


@functools.lru_cache(maxsize=64)
def _tables(
    inst: Instance, device: str
) -> tuple[torch.Tensor, np.ndarray, torch.Tensor, torch.Tensor | None]:
    """(look-up table, byte offsets and shifts of the packed indices, mix or None) on `device`."""
    offset, shift = index_positions(inst.m, inst.bits)
    q = inst.rotation.matrix.shape[0]
    mix = torch.from_numpy(inst.rotation.matrix_t).to(device) if q > 1 else None
    shifts = torch.from_numpy(shift).to(device=device, dtype=torch.int32)
    return torch.from_numpy(inst.table).to(device), offset, shifts, mix


@functools.lru_cache(maxsize=64)
def _factor_values(inst: Instance) -> np.ndarray:
    """What a rotated-back coordinate is multiplied by first: 1 / sqrt(p) with R's sign (the
    kernel's _scale_factors)."""
    scale = np.float32(1.0 / math.sqrt(inst.m // max(1, inst.rotation.matrix.shape[0])))
    return np.where(inst.rotation.signs < 0, -scale, scale).astype(np.float32)


def _factors(inst: Instance, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_factor_values(inst)).to(device)
