"""One batched torch decode of many payloads: bit for bit the Numba decode, on any torch device.

A restore's payloads are copied as they arrive into one host buffer (`Received`: pinned when the
decode runs on CUDA, reused batch after batch on the CPU: `HostMemory`); `decode_batch` then copies
that buffer to the device once, groups the payloads by header (codec, dtype, shape, and a key-aware
body's prefix), and decodes each group with vectorised torch operations written straight into the
blocks: none is a copy, INT8 a multiply per group of values, TurboQuant a table look-up of its
packed indices, its Walsh-Hadamard butterflies stage by stage (and the mix of its Hadamard blocks),
its scaling and the conversion, with each payload's channel order, means and sink tokens. A K/V pair
payload is its two halves, each decoded with the halves of the other pair payloads. On a device a
group is one chunk (a fixed number of operations whatever its payload count); on the CPU it is
decoded in chunks of whole vectors small enough for each operation to run on the calling thread
(`_CPU_CHUNK`).

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

from tierkv.quant import int8, lossless, sinks, turbo
from tierkv.quant.base import CodecFamily
from tierkv.quant.codec import FAMILY_OF, checked_body
from tierkv.quant.pair import is_pair, parse_pair
from tierkv.quant.payload import PayloadError, PayloadHeader, parse_header
from tierkv.quant.turbo import Instance, TurboCodec, index_positions, named_codec

_FLOAT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_MAX_FINITE = {name: torch.finfo(t).max for name, t in _FLOAT.items()}


class HostMemory:
    """Where the host buffers of one part's batches come from (one per mover part). Pinned
    (`pin`, for a CUDA decode): a fresh buffer per batch, since the device copy of the last
    batch may still read its own (torch caches pinned memory). Otherwise one buffer, grown as
    needed and handed out again: a CPU decode is done with a batch before the next one is
    received, and a fresh 40 MB buffer per batch faulted every page in again."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self._kept = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of host memory for one batch."""
        if self.pin:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if self._kept.numel() < nbytes:
            self._kept = torch.empty(nbytes, dtype=torch.uint8)
        return self._kept[:nbytes]


class Received:
    """The payloads of one batch of `capacity` blocks in one host buffer (from `memory`):
    payload i at row i of [capacity, stride] bytes. The stride is the first payload's length and
    a quarter more (a restore's payloads of one codec are about as long: the larger first block
    of a key-aware codec, with its sink tokens, fits), so each group of equal payloads is one
    indexed row copy, and the device copy about the bytes received."""

    def __init__(self, capacity: int, memory: HostMemory) -> None:
        self.capacity = capacity
        self._memory = memory
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
                self.data = self._memory.take(self.capacity * stride)
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
    prefix = _DECODERS[FAMILY_OF[header.codec]].prefix(header, body)
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
    start = members[0][2] - key.body_bytes  # the same offset in every member's payload
    slots = np.asarray([index for index, _, _ in members], dtype=np.int64)
    group = _Group(host, data, slots, start)
    kind = _DECODERS[FAMILY_OF[key.header.codec]]
    decoder = kind.of(key, group)
    ok = decoder.ok
    if not ok.all():
        group = _Group(host, data, slots[ok], start)
        decoder = kind.of(key, group)
    target = out
    cols = 1
    if key.half is not None:
        (axis, first, last), _ = key.half
        target = out.narrow(axis + 1, first, last - first)
        cols = math.prod(target.shape[axis + 1 :])
    n = key.header.size
    # [blocks, rows, cols] words: a chunk of whole rows is a view of the target
    rows = target.view(len(out), n // cols, cols).view(_FLOAT[key.header.dtype])
    _chunks(decoder, group, rows, n, cols)
    return {index for (index, _, _), good in zip(members, ok, strict=True) if not good}


def _chunks(decoder: _Decoder, group: _Group, target: torch.Tensor, n: int, cols: int) -> None:
    """Decode the group chunk by chunk into `target` [blocks, rows, cols]: on the CPU, chunks of
    about _CPU_CHUNK values (whole payloads when they are smaller); on a device, the whole group
    at once."""
    count = len(group.slots)
    per_rows, per_values = count, n
    if target.device.type == "cpu":
        unit = math.lcm(decoder.unit, cols)
        if n <= _CPU_CHUNK:
            per_rows = max(1, _CPU_CHUNK // n)
        else:
            per_rows, per_values = 1, max(unit, _CPU_CHUNK // unit * unit)
    for first in range(0, count, per_rows):
        rows = slice(first, min(count, first + per_rows))
        for a in range(0, n, per_values):
            b = min(n, a + per_values)
            _write_rows(target[:, a // cols : b // cols], group, rows, decoder(rows, a, b))


_CPU_CHUNK = 1 << 15
"""Values a CPU decode works on at once. ATen runs an operation of at most 32,768 elements on
the calling thread; a larger one wakes an OpenMP team and waits for it at the end, which on a
machine whose cores are busy costs a time slice per operation (measured on the bench shape,
load 3-4 on 2 cores: chunks of 256k values ran int8 at 0.016-1.6 GB/s from run to run, 32k
values at 0.3-0.95). The chunk's temporaries stay in cache and come back from the allocator
already mapped (a pass over a whole batch's values in fresh memory is mostly page faults).
On an idle machine larger chunks are faster (256k: int8 3.8 GB/s); a device decodes a group
at once."""


class _Group:
    """The bodies of one group's payloads: row slots[i] of the received buffer from `start`,
    on the decode device (`data`) and on the host (`host`)."""

    def __init__(self, host: np.ndarray, data: torch.Tensor, slots: np.ndarray, start: int):
        self.host, self.data, self.slots, self.start = host, data, slots, start
        self.index = torch.from_numpy(slots).to(data.device)

    def host_bytes(self, a: int, b: int) -> np.ndarray:
        """Bytes a:b of every body, on the host [G, b - a] (small fields: headers, masks)."""
        return self.host[self.slots, self.start + a : self.start + b]

    def bytes(self, rows: slice, a: int, b: int) -> torch.Tensor:
        """Bytes a:b of bodies `rows` on the device, [rows, b - a] uint8."""
        if rows.stop - rows.start == 1:  # a view
            slot = int(self.slots[rows.start])
            return self.data[slot : slot + 1, self.start + a : self.start + b]
        return self.data[self.index[rows], self.start + a : self.start + b]

    def values(self, rows: slice, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Bytes a:b of bodies `rows` as `dtype` words (copied: they may start at an odd byte)."""
        return self.bytes(rows, a, b).clone(memory_format=torch.contiguous_format).view(dtype)


class _Decoder:
    """One group's decode, a chunk at a time: __call__(rows, a, b) is values a:b of bodies
    `rows` as words [rows, b - a] of the payloads' dtype, their float32 values, or their bytes;
    a chunk starts at a multiple of `unit`. `ok`: which bodies are valid. Each family's is in
    _DECODERS."""

    unit = 1

    def __init__(self, group: _Group, header: PayloadHeader) -> None:
        self.group, self.header = group, header
        self.ok = np.ones(len(group.slots), bool)

    @staticmethod
    def prefix(header: PayloadHeader, body: memoryview) -> bytes:
        """The bytes of a checked body that the payloads of one group share besides their
        header (none here); PayloadError when the body is malformed, _NotBatched when this
        decode does not handle it."""
        return b""

    @classmethod
    def of(cls, key: _Key, group: _Group) -> _Decoder:
        """The decode of a group of payloads with `key`."""
        return cls(group, key.header)

    def __call__(self, rows: slice, a: int, b: int) -> torch.Tensor:
        raise NotImplementedError


class _Raw(_Decoder):
    """Codec none: the body is the words."""

    def __init__(self, group: _Group, header: PayloadHeader) -> None:
        super().__init__(group, header)
        self.dtype = _FLOAT[header.dtype]

    def __call__(self, rows: slice, a: int, b: int) -> torch.Tensor:
        size = self.dtype.itemsize
        return self.group.bytes(rows, a * size, b * size)


class _Int8(_Decoder):
    """INT8 bodies: clamped float32 values (the step of each group of values computed once)."""

    def __init__(self, group: _Group, header: PayloadHeader) -> None:
        super().__init__(group, header)
        self.unit = header.group_size
        n_groups = -(-header.size // header.group_size)
        scales = group.values(slice(0, len(group.slots)), 2, 2 + 2 * n_groups, torch.float16)
        pow2k = _pow2k(group.host_bytes(0, 2), group.data.device)  # [G, 1] float64
        self.steps = (scales.double() * pow2k).float()
        self.q_at = 2 + 2 * n_groups

    def __call__(self, rows: slice, a: int, b: int) -> torch.Tensor:
        group_size = self.header.group_size
        first, last = a // group_size, -(-b // group_size)
        q = self.group.bytes(rows, self.q_at + a, self.q_at + b).view(torch.int8)
        g = len(q)
        pad = (last - first) * group_size - (b - a)
        if pad:
            q = torch.cat([q, q.new_zeros((g, pad))], dim=1)
        steps = self.steps[rows, first:last, None]
        x = (q.view(g, last - first, group_size) * steps).view(g, -1)[:, : b - a]
        bound = _MAX_FINITE[self.header.dtype]
        return x.clamp_(-bound, bound)


class _Turbo(_Decoder):
    """TurboQuant bodies (a sink codec's: after its prefix, means and sink tokens, given its
    `parts`), with their channel orders, means and sink tokens."""

    @staticmethod
    def prefix(header: PayloadHeader, body: memoryview) -> bytes:
        codec = named_codec(header.codec, header.group_size, header.version)
        if any(_dense(inst) for _, inst, _ in codec.instances()):
            raise _NotBatched
        return b""

    @classmethod
    def of(cls, key: _Key, group: _Group) -> _Decoder:
        header = key.header
        return cls(group, named_codec(header.codec, header.group_size, header.version), header)

    def __init__(
        self,
        group: _Group,
        codec: TurboCodec,
        header: PayloadHeader,
        parts: sinks.Parts | None = None,
    ) -> None:
        super().__init__(group, header)
        self.codec = codec
        d, device = codec.group_size, group.data.device
        self.unit = d
        self.layout = layout = codec.layout(header.shape)
        self.at = 0  # the TurboQuant body's offset in the body
        self.means: tuple[int, int, int, torch.Tensor] | None = None
        self.sinks: tuple[int, np.ndarray, torch.Tensor] | None = None
        if parts is not None:
            means_end = sinks.PREFIX.size + len(parts.means)
            self.at = means_end + len(parts.raw)
            outer, tokens, inner = parts.blocks
            if len(parts.means):
                per = inner // d
                v = torch.arange(layout.n_vectors, device=device)
                rows = (v // (per * tokens)) * per + v % per  # vector v's row of means
                self.means = (sinks.PREFIX.size, per, tokens, rows)
            if parts.count:
                at = _sink_positions(outer, tokens, inner, parts.count)
                self.sinks = (means_end, at, torch.from_numpy(at).to(device))
        g = len(group.slots)
        self.order = None
        if codec.lo is not None:
            masks = group.host_bytes(self.at + 2, self.at + layout.norms_offset)
            bits = np.unpackbits(masks.reshape(g, layout.sel_mod, -1), axis=2, bitorder="little")
            bits = bits[:, :, :d]
            self.ok = (bits.sum(axis=2) == codec.hi.m).all(axis=1)
            order = torch.from_numpy(bits).to(device).argsort(dim=2, descending=True, stable=True)
            self.order = order  # [G, groups, d]: group s's channel of its word j
            self.sel = (torch.arange(layout.n_vectors, device=device) // layout.sel_div) % (
                layout.sel_mod
            )
        self.pow2k = _pow2k(group.host_bytes(self.at, self.at + 2), device).float()[:, :, None]

    def __call__(self, rows: slice, a: int, b: int) -> torch.Tensor:
        codec, layout, group = self.codec, self.layout, self.group
        d, at = codec.group_size, self.at
        first, last = a // d, b // d
        n, ni = last - first, layout.n_instances
        norms_at = at + layout.norms_offset
        norms = group.values(
            rows, norms_at + 2 * ni * first, norms_at + 2 * ni * last, torch.float16
        )
        g = len(norms)
        norms = norms.float().view(g, n, ni)
        per_vector = layout.bytes_per_vector
        indices_at = at + layout.indices_offset
        indices = group.bytes(rows, indices_at + per_vector * first, indices_at + per_vector * last)
        indices = indices.view(g, n, per_vector)
        pow2k = self.pow2k[rows]
        centre = None
        if self.means is not None:
            means_at, per, tokens, mean_rows = self.means
            low = (first // (per * tokens)) * per
            high = ((last - 1) // (per * tokens)) * per + per
            means = group.values(
                rows, means_at + 2 * d * low, means_at + 2 * d * high, torch.float16
            )
            centre = means.float().view(g, high - low, d)
            centre = centre.index_select(1, mean_rows[first:last] - low)
        words = torch.empty((g, n, d), dtype=_FLOAT[self.header.dtype], device=norms.device)
        for i, (start, inst, byte_at) in enumerate(codec.instances()):
            x = _levels(indices, inst, byte_at)  # a temporary: scaled in place, in order
            x.mul_(_factors(inst, x.device)).mul_(norms[:, :, i : i + 1]).mul_(pow2k)
            if centre is not None:
                x.add_(centre)
            words[:, :, start : start + inst.m] = _words(x, self.header.dtype)
        if self.order is not None:
            merged = torch.empty_like(words)
            merged.scatter_(2, self.order[rows].index_select(1, self.sel[first:last]), words)
            words = merged
        words = words.view(g, -1)
        if self.sinks is not None:
            raw_at, positions, on_device = self.sinks
            low, high = np.searchsorted(positions, (a, b))
            if high > low:
                size = words.element_size()
                raw = group.values(rows, raw_at + size * low, raw_at + size * high, words.dtype)
                words.index_copy_(1, on_device[low:high] - a, raw)
        return words


class _SinkTurbo(_Turbo):
    """Key-aware bodies: a group shares its prefix (token axis, centred, sink tokens)."""

    @staticmethod
    def prefix(header: PayloadHeader, body: memoryview) -> bytes:
        sinks.named_codec(header.codec, header.group_size).parts(header, np.asarray(body))
        return bytes(body[: sinks.PREFIX.size])

    @classmethod
    def of(cls, key: _Key, group: _Group) -> _Decoder:
        header = key.header
        codec = sinks.named_codec(header.codec, header.group_size)
        parts, _ = codec.parts(header, group.host_bytes(0, key.body_bytes)[0])
        return cls(group, codec.turbo, header, parts)


_DECODERS: dict[CodecFamily, type[_Decoder]] = {
    lossless.FAMILY: _Raw,
    int8.FAMILY: _Int8,
    turbo.FAMILY: _Turbo,
    sinks.FAMILY: _SinkTurbo,
}
"""Each family's batched decode."""


@functools.lru_cache(maxsize=16)
def _sink_positions(outer: int, tokens: int, inner: int, count: int) -> np.ndarray:
    """The flat positions of the sink tokens' values in a block [outer, tokens, inner],
    ascending (the order of their raw words)."""
    rows = np.arange(outer)[:, None] * tokens * inner + np.arange(count * inner)[None, :]
    return rows.reshape(-1)


def _write_rows(target: torch.Tensor, group: _Group, rows: slice, values: torch.Tensor) -> None:
    """target[slot] = values[i] for each slot of group rows `rows`, converted to the target's
    dtype (uint8 values: its bytes). Values to convert, of one block: a copy into its view;
    else one index_copy_ on a device, on the CPU numpy's fancy indexing (on this thread; torch's
    index_copy_ of 16-bit words measured an order of magnitude slower)."""
    if values.dtype == torch.uint8:
        target = target.view(torch.uint8)
    if rows.stop - rows.start == 1 and values.dtype != target.dtype:
        view = target[int(group.slots[rows.start])]
        view.copy_(values.view(view.shape))
        return
    values = values.to(target.dtype).view(len(values), *target.shape[1:])
    if target.device.type != "cpu":
        target.index_copy_(0, group.index[rows], values)
        return
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[target.element_size()]
    target.view(as_int).numpy()[group.slots[rows]] = values.view(as_int).numpy()


def _pow2k(head: np.ndarray, device: torch.device) -> torch.Tensor:
    """Each body's 2**k (the int16 `head` [G, 2] bytes) as float64 [G, 1]."""
    k = head.copy().view("<i2")[:, 0].astype(np.int64)
    return torch.from_numpy(np.ldexp(1.0, k)[:, None]).to(device)


def _words(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """float32 values clamped to the finite range of `dtype` and rounded to it."""
    bound = _MAX_FINITE[dtype]
    return x.clamp_(-bound, bound).to(_FLOAT[dtype])


def _levels(packed: torch.Tensor, inst: Instance, byte_at: int) -> torch.Tensor:
    """One instance's values of every vector, rotated back up to its scale factors: the
    look-up table's levels (with its first butterfly stages), the mix of Hadamard blocks, the
    remaining butterflies. `packed`: [G, n, bytes per vector] uint8; [G, n, m] float32."""
    device = packed.device
    table, offset, shift, mix = _tables(inst, str(device))
    per_entry = inst.table.shape[1]
    width = inst.bits * per_entry  # bits of a table entry's code
    word = math.lcm(8, width) // 8  # bytes of a whole number of codes
    count = inst.m // per_entry  # codes per vector
    if width == 8 and inst.m % 8 == 0:  # a table entry is a whole byte
        codes = packed[..., byte_at : byte_at + count].long()
    elif count * width % (8 * word) == 0:  # the codes fill whole words of the bit stream
        # the packed indices are an LSB-first bit stream: a code is one field of `width` bits
        words = count * width // (8 * word)
        stream = packed[..., byte_at : byte_at + words * word]
        parts = stream.reshape(*stream.shape[:-1], words, word).to(torch.int64).unbind(-1)
        value = parts[0]
        for i in range(1, word):
            value = value | (parts[i] << (8 * i))
        fields = _field_shifts(width, word, str(device))
        codes = ((value.unsqueeze(-1) >> fields) & ((1 << width) - 1)).flatten(-2)
    else:
        indices = torch.cat([packed, packed.new_zeros((*packed.shape[:-1], 1))], dim=-1)
        indices = indices.to(torch.int32)
        at = torch.from_numpy(offset + byte_at).to(device)
        idx = ((indices[..., at] | (indices[..., at + 1] << 8)) >> shift) & ((1 << inst.bits) - 1)
        codes = idx[..., 0::per_entry]
        for e in range(1, per_entry):
            codes = codes | (idx[..., e::per_entry] << (inst.bits * e))
        codes = codes.long()
    # the entries' float32 levels moved as 64-bit words (one look-up per entry)
    y = table.index_select(0, codes.reshape(-1)).view(torch.float32)
    y = y.view(*codes.shape[:-1], inst.m)  # [G, n, m]
    if mix is None:
        return _butterflies(y, per_entry)
    q = len(mix)
    blocks = y.view(*y.shape[:-1], q, inst.m // q)
    z = torch.empty_like(blocks)
    parts = blocks.unbind(-2)
    zero = torch.zeros((), device=device)
    for row, out in zip(mix, z.unbind(-2), strict=True):
        acc = zero + row[0] * parts[0]
        for c, part in zip(row[1:], parts[1:], strict=True):
            acc = acc + c * part
        out.copy_(acc)
    return _butterflies(z, 1).flatten(-2)


def _butterflies(y: torch.Tensor, first: int) -> torch.Tensor:
    """The Walsh-Hadamard stages of distance first .. size / 2 on the last axis of `y` (a
    contiguous temporary, overwritten): each pair (a, b) becomes (a + b, a - b), stage by stage
    (the kernel's order, so the same bits), between two buffers."""
    size = y.shape[-1]
    h = first
    z = torch.empty_like(y) if h < size else y
    while h < size:
        shape = (*y.shape[:-1], size // (2 * h), 2, h)
        a, b = y.view(shape).unbind(-2)
        sums, differences = z.view(shape).unbind(-2)
        torch.add(a, b, out=sums)
        torch.sub(a, b, out=differences)
        y, z = z, y
        h *= 2
    return y


@functools.lru_cache(maxsize=64)
def _tables(
    inst: Instance, device: str
) -> tuple[torch.Tensor, np.ndarray, torch.Tensor, list[list[torch.Tensor]] | None]:
    """(look-up table as 64-bit words, one row per entry (1-D for two levels an entry), byte
    offsets and shifts of the packed indices, mix or None) on `device`."""
    offset, shift = index_positions(inst.m, inst.bits)
    q = inst.rotation.matrix.shape[0]
    mix = None
    if q > 1:  # its rows of 0-d tensors (float32 products, as the kernel's)
        matrix = torch.from_numpy(inst.rotation.matrix_t).to(device)
        mix = [list(row.unbind()) for row in matrix]
    shifts = torch.from_numpy(shift).to(device=device, dtype=torch.int32)
    table = torch.from_numpy(inst.table).to(device).view(torch.int64)
    return table.squeeze(1) if table.shape[1] == 1 else table, offset, shifts, mix


@functools.lru_cache(maxsize=16)
def _field_shifts(width: int, word: int, device: str) -> torch.Tensor:
    """The bit offsets of the codes of `width` bits in a little-endian word of `word` bytes."""
    return torch.arange(0, 8 * word, width, device=device)


@functools.lru_cache(maxsize=64)
def _factor_values(inst: Instance) -> np.ndarray:
    """What a rotated-back coordinate is multiplied by first: 1 / sqrt(p) with R's sign (the
    kernel's _scale_factors)."""
    scale = np.float32(1.0 / math.sqrt(inst.m // max(1, inst.rotation.matrix.shape[0])))
    return np.where(inst.rotation.signs < 0, -scale, scale).astype(np.float32)


def _factors(inst: Instance, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_factor_values(inst)).to(device)
