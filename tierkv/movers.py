"""Batched block movement between an engine's paged KV buffers and staging memory (torch + numpy).

No engine is imported here, so this moves and is benchmarked the same on any torch device.
A group's paged buffer is, per layer, a tensor with one dimension indexed by block id (any
layout). A block is stored as parts: part p of block b is layer[l].select(dim, b) of every layer
l of part p, stacked ([layers, *block]); attention has one part, a Mamba layer one per state.

- `BlockMover.store(block_ids)` gathers many blocks at once, with one indexed copy per layer
  and part over an array of block ids (torch `index_select` on a device; numpy fancy indexing
  on the CPU, which copies at about memcpy speed), into a region of a reusable host
  `StagingRing` (pinned when the buffers live on CUDA). The region's numpy views feed the codecs.
- `BlockMover.staging(n)` hands out staging the codecs decode n blocks into (host, or the
  device for device decode); `BlockMover.scatter(staged, slots, block_ids)` writes the decoded
  slots into their engine blocks with one indexed copy per layer and part. Slots that failed to
  decode are simply left out, so their bytes never reach the paged buffer.
- `BlockMover.load(block_ids, fetch, ...)` restores blocks as their payloads arrive. On the CPU,
  lossless payloads are not decoded at all. With blocks-first layers (vLLM CPU's) the receive
  places each one: its header into a row of a small array, its body straight into its engine
  block, layer by layer (the socket's copy is the only one); a payload whose checksum or header
  then fails is reported failed, and vLLM recomputes (overwrites) that block before reading it.
  With other layouts, payloads received back to back in one buffer are a strided numpy view,
  and one indexed copy per layer writes them from the receive buffer into the paged buffer
  while the rest is on the wire. Other codecs decode into the batch's staging, scattered once
  per batch: on the host with Numba, or (device decode) in one batched torch decode per batch,
  whose payloads land in one (pinned) host buffer and cross to the device in one copy.

Nothing here issues torch operations per block: the work per call is a constant number of
operations per layer and part, whatever the number of blocks.

On CUDA both directions are asynchronous. A store's gather runs on the engine's current stream
(a device-to-device copy into a private buffer), and the device-to-host copy of that private
buffer runs on a side stream, ending in an event; the engine thread never waits. Why no block is
overwritten before it is copied: the gather is enqueued on the engine's stream before the
forward pass that follows it, and a stream runs its kernels in order, so it has read every
block before any later kernel of that stream (the only writer of the paged buffer) can touch it;
the side stream then reads only the private copy. Encoding waits for the event
(`Staged.wait()`). A load's host-to-device copy and scatter run on a load stream ending in an
event; the caller reports the blocks loaded only once that event has completed (or makes the
engine's stream wait on it), and vLLM reads none of them before that.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tierkv.codecs import FRAMEWORK_DTYPES

if TYPE_CHECKING:
    from tierkv.load import Block, Consume
    from tierkv.quant.torch_batch import HostMemory, Received
    from tierkv.real_axes import RealAxes
    from tierkv.transfer import Into

ALIGN = 256
"""Regions and parts start on multiples of this many bytes (any dtype view, DMA friendly)."""
CODEC_DTYPES = {getattr(torch, name): ours for name, ours in FRAMEWORK_DTYPES.items()}
"""The torch dtypes the codecs take, by their codec dtype name."""
_HEADER_VERDICTS = 64
"""Payload headers whose verdict a mover remembers (see BlockMover._lossless_header)."""


Fetch = Callable[[int, int, "Consume", "Into | None"], set[int]]
"""fetch(start, stop, consume, into) -> failed indices, relative to start (BlockMover.load)"""
Send = Callable[[int, int, np.ndarray, str, Callable[[], None]], None]
"""send(index, part, array, codec dtype, on_done); see hand_over"""


def codec_dtype(dtype: torch.dtype, what: str) -> str:
    """The codec dtype name of `dtype`; ValueError naming `what` for any other."""
    try:
        return CODEC_DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"tierkv: {what} holds {dtype}; supported KV dtypes are "
            f"{', '.join(sorted(FRAMEWORK_DTYPES))}"
        ) from None


def numpy_words(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor, bf16 as its 16-bit words (what the codecs read and write)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StagingRing:
    """A fixed host buffer handed out in regions and reclaimed in the order they were taken.

    Regions may be released in any order; a region's space is reused once it and every region
    taken before it are released (like a log). The memory is allocated on first use and pinned
    when `pin` (page-locked memory is what lets CUDA copy asynchronously; then it is allocated
    at once).
    """

    def __init__(self, nbytes: int, *, pin: bool = False) -> None:
        self.nbytes = nbytes
        # Pinned memory is allocated here, not on an engine step's first store (allocating and
        # page-locking a large buffer takes a large part of a second).
        self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pin else None
        self._lock = threading.Lock()
        self._live: deque[list[int]] = deque()  # [start, end, released], oldest first

    def largest_free(self) -> int:
        """The largest region `take` could hand out now."""
        with self._lock:
            return max(self._free_spans(), default=0)

    def take(self, nbytes: int) -> Region | None:
        """A region of at least `nbytes`, or None when no free span is that large now."""
        size = _aligned(max(nbytes, 1))
        with self._lock:
            start = next(
                (
                    s
                    for s, free in zip(self._starts(), self._free_spans(), strict=True)
                    if free >= size
                ),
                None,
            )
            if start is None:
                return None
            if self._buffer is None:
                self._buffer = torch.empty(self.nbytes, dtype=torch.uint8)
            entry = [start, start + size, 0]
            self._live.append(entry)
            return Region(self, entry, self._buffer[start : start + size])

    def _starts(self) -> list[int]:
        if not self._live:
            return [0]
        tail, head = self._live[0][0], self._live[-1][1]
        return [head, 0] if head > tail else [head]

    def _free_spans(self) -> list[int]:
        """Free bytes at each of `_starts()`."""
        if not self._live:
            return [self.nbytes]
        tail, head = self._live[0][0], self._live[-1][1]
        if head > tail:  # not wrapped: free after the newest region and before the oldest
            return [self.nbytes - head, tail]
        return [tail - head]

    def _release(self, entry: list[int]) -> None:
        with self._lock:
            entry[2] = 1
            while self._live and self._live[0][2]:
                self._live.popleft()


class Region:
    """Bytes of a StagingRing (`data`, uint8) until `release()`."""

    def __init__(self, ring: StagingRing, entry: list[int], data: torch.Tensor) -> None:
        self.data = data
        self._ring = ring
        self._entry = entry

    def release(self) -> None:
        if self._entry[2] == 0:
            self._ring._release(self._entry)


def countdown(count: int, then: Callable[[], None]) -> Callable[[], None]:
    """A callback that runs `then` on its `count`-th call (from any thread)."""
    lock = threading.Lock()
    left = [count]

    def tick() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    if count == 0:
        then()
    return tick


@dataclass
class Staged:
    """n blocks in staging: per part, a tensor [n, layers, *block] (host or device).

    `wait()` returns once the bytes are complete (a CUDA event; at once on CPU). `release()`
    hands ring memory back; call it once nothing reads the tensors any more.
    """

    tensors: list[torch.Tensor]
    region: Region | None = None
    event: torch.cuda.Event | None = None
    keep: list[torch.Tensor] = field(default_factory=list)
    """Device buffers that an asynchronous copy still reads or writes."""
    keep_host: np.ndarray | None = None
    """A load's blocks decoded in their real axes (BlockMover.real), before they are put back."""

    @property
    def count(self) -> int:
        return self.tensors[0].shape[0]

    def arrays(self) -> list[np.ndarray]:
        """Numpy views of host tensors, one per part (bf16 as 16-bit words)."""
        return [numpy_words(tensor) for tensor in self.tensors]

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def release(self) -> None:
        self.keep.clear()
        if self.region is not None:
            self.region.release()


class BlockMover:
    """Moves blocks of one paged buffer (one KV-cache group) to and from staging in batches."""

    def __init__(
        self,
        parts: Sequence[Sequence[tuple[torch.Tensor, int]]],
        store_ring: StagingRing,
        load_ring: StagingRing,
        real: RealAxes | None = None,
    ) -> None:
        """`parts[p]` lists, per layer, the tensor and its block dimension; every layer of a part
        has the same block shape and dtype. `real`: a one-part host mover whose lossy payloads
        hold blocks in their real axes (tierkv.real_axes; they are decoded in those and put
        back before the scatter)."""
        self.parts = [list(layers) for layers in parts]
        self.real = real
        first = self.parts[0][0][0]
        self.device = first.device
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[torch.dtype] = []
        for layers in self.parts:
            tensor, dim = layers[0]
            block = tuple(tensor.shape[:dim] + tensor.shape[dim + 1 :])
            for other, other_dim in layers:
                other_block = tuple(other.shape[:other_dim] + other.shape[other_dim + 1 :])
                if other_block != block or other.dtype != tensor.dtype:
                    raise ValueError(
                        f"tierkv: layers of one part differ: blocks {block} {tensor.dtype} "
                        f"and {other_block} {other.dtype}"
                    )
            self.shapes.append((len(layers), *block))
            self.dtypes.append(tensor.dtype)
        self.store_ring = store_ring
        self.load_ring = load_ring
        # On the CPU, numpy's fancy indexing copies blocks at about memcpy speed (torch's
        # index_select / index_copy_ measured 2-4x slower on bf16 here): the same batched
        # gather / scatter, with each layer as a numpy view whose first axis is the block id.
        self._host_layers = (
            [
                [np.moveaxis(numpy_words(tensor), dim, 0) for tensor, dim in layers]
                for layers in self.parts
            ]
            if self.device.type == "cpu"
            else None
        )
        self._header_verdicts: dict[bytes, bool] = {}  # see _lossless_header
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._load_stream = torch.cuda.Stream(self.device) if cuda else None
        self._received_memory: list[HostMemory] = []  # per part, made at the first device decode

    @property
    def codec_dtypes(self) -> list[str]:
        return [codec_dtype(dtype, "a KV block") for dtype in self.dtypes]

    def part_bytes(self, part: int) -> int:
        """Bytes of one block's part (all its layers)."""
        return int(np.prod(self.shapes[part])) * self.dtypes[part].itemsize

    @property
    def block_bytes(self) -> int:
        return sum(self.part_bytes(part) for part in range(len(self.parts)))

    def region_bytes(self, n: int) -> int:
        return sum(_aligned(n * self.part_bytes(part)) for part in range(len(self.parts)))

    def fitting(self, n: int, ring: StagingRing) -> int:
        """How many of n blocks fit in `ring`'s largest free span now."""
        free = ring.largest_free()
        fit = min(n, free // max(1, self.block_bytes))
        while fit and self.region_bytes(fit) > free:
            fit -= 1
        return fit

    # ---- stores ----------------------------------------------------------------------------

    def store(self, block_ids: Sequence[int]) -> Staged | None:
        """Copy `block_ids` into host staging (None when the store ring has no room for them).

        On CPU the copy is done when this returns; on CUDA it is in flight (`Staged.wait()`).
        """
        region = self.store_ring.take(self.region_bytes(len(block_ids)))
        if region is None:
            return None
        n = len(block_ids)
        host = self._views(region.data, n)
        if self._host_layers is not None:
            host_ids = np.asarray(block_ids, dtype=np.int64)
            for out, layers in zip(host, self._host_layers, strict=True):
                words = numpy_words(out)
                for layer, array in enumerate(layers):
                    words[:, layer] = array[host_ids]
            return Staged(host, region)
        ids = torch.tensor(block_ids, dtype=torch.long)
        if self._copy_stream is not None:
            # A copy from pageable memory first waits for the engine's stream (its whole
            # enqueued forward pass); from pinned memory it is enqueued at once.
            ids = ids.pin_memory()
        ids = ids.to(self.device, non_blocking=True)
        if self._copy_stream is None:
            for part, out in enumerate(host):
                self._gather(part, ids, out)
            return Staged(host, region)
        # CUDA: gather on the engine's stream (ordered before any later write of these blocks),
        # then copy the private buffer to pinned host memory on the side stream.
        engine = torch.cuda.current_stream(self.device)
        private = [torch.empty(out.shape, dtype=out.dtype, device=self.device) for out in host]
        for part, out in enumerate(private):
            self._gather(part, ids, out)
        self._copy_stream.wait_stream(engine)
        event = torch.cuda.Event()
        with torch.cuda.stream(self._copy_stream):
            for src, dst in zip(private, host, strict=True):
                dst.copy_(src, non_blocking=True)
            event.record(self._copy_stream)
        return Staged(host, region, event, keep=private)

    def _gather(self, part: int, ids: torch.Tensor, out: torch.Tensor) -> None:
        for layer, (tensor, dim) in enumerate(self.parts[part]):
            torch.index_select(tensor, dim, ids, out=out.select(1, layer).movedim(0, dim))

    # ---- loads -----------------------------------------------------------------------------

    def staging(self, n: int, *, on_device: bool = False) -> Staged:
        """Staging for n decoded blocks: a load-ring region (a fresh host buffer when the ring
        has no room), or a device buffer when `on_device` (device decode)."""
        if on_device:
            with _on_stream(self._load_stream):
                return Staged(
                    [
                        torch.empty((n, *shape), dtype=dtype, device=self.device)
                        for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
                    ]
                )
        size = self.region_bytes(n)
        region = self.load_ring.take(size)
        pin = self.device.type == "cuda"
        data = (
            region.data
            if region is not None
            else torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        )
        return Staged(self._views(data, n), region)

    def scatter(self, staged: Staged, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Write staged slot `slots[i]` into engine block `block_ids[i]`, for every i.

        On CUDA the copies run on the load stream and `staged.event` marks their end; the blocks
        must not be read, nor `staged` released, before it has completed.
        """
        if not block_ids:
            return
        all_slots = list(slots) == list(range(staged.count))
        if self._host_layers is not None:
            host_ids = np.asarray(block_ids, dtype=np.int64)
            for source, layers in zip(staged.tensors, self._host_layers, strict=True):
                words = numpy_words(source)
                if not all_slots:
                    words = words[np.asarray(slots, dtype=np.int64)]
                for layer, array in enumerate(layers):
                    array[host_ids] = words[:, layer]
            return
        ids = torch.tensor(block_ids, dtype=torch.long)
        picked = None if all_slots else torch.tensor(slots, dtype=torch.long)
        stream = self._load_stream
        if stream is None:
            self._scatter(staged.tensors, picked, ids)
            return
        # The blocks vLLM allocated may still be written by kernels it enqueued before: start
        # after everything on the engine's stream so far.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            sources = [tensor.to(self.device, non_blocking=True) for tensor in staged.tensors]
            self._scatter(sources, picked, ids.to(self.device, non_blocking=True))
            event.record(stream)
        staged.keep.extend(sources)
        staged.event = event

    def load(
        self, block_ids: Sequence[int], fetch: Fetch, *, batch_blocks: int, on_device: bool = False
    ) -> set[int]:
        """Restore blocks into engine blocks `block_ids`, in batches of `batch_blocks`; the
        indices (into block_ids) that failed.

        Per batch, `fetch(start, stop, consume, into)` fetches blocks start..stop-1 and hands
        them to `consume(blocks)` as their payloads arrive ((i - start, part, payload), every
        part of a block in one call), which returns the ones it could not restore; fetch
        returns every failed one (relative to start). Blocks are decoded into host staging with
        the Numba codecs, or with `on_device` copied as they arrive into one host buffer per
        part (pinned on CUDA) and decoded into device staging with one batched torch decode
        (tierkv.quant.torch_batch: one device copy, one decode per codec), and one scatter per
        batch writes them. With host layers and one part, lossless payloads skip
        all that: `into` (None otherwise) has the receive place each one straight into its
        engine block when every layer's block is contiguous (`_placing`), else each call
        copies them from the receive buffers into the paged buffer (`_scatter_lossless`) while
        the rest of the batch is still on the wire; the scatter leaves them out. Returns once
        every copy has completed (on CUDA: its event), so the blocks may be reported loaded.
        """
        from tierkv.load import SWITCH_INTERVAL_WHILE_LOADING

        with SWITCH_INTERVAL_WHILE_LOADING:  # its copies too (see LOAD_SWITCH_INTERVAL_S)
            return self._load(block_ids, fetch, batch_blocks, on_device)

    def _load(
        self, block_ids: Sequence[int], fetch: Fetch, batch_blocks: int, on_device: bool
    ) -> set[int]:
        # Real axes are vLLM CPU's layout, whose blocks live in host memory: decoded on the host.
        on_device = on_device and self.real is None
        direct = self._host_layers is not None and len(self.parts) == 1 and not on_device
        placeable = direct and self._placeable()
        failed: set[int] = set()
        in_flight: deque[Staged] = deque()
        try:
            for start in range(0, len(block_ids), batch_blocks):
                ids = block_ids[start : start + batch_blocks]
                while in_flight and self.fitting(len(ids), self.load_ring) < len(ids):
                    oldest = in_flight.popleft()  # its copies must end before its staging
                    oldest.wait()  # is reused
                    oldest.release()
                staged = self.staging(len(ids), on_device=on_device)
                in_flight.append(staged)
                decode: Consume
                received: list[Received] = []
                if on_device:
                    from tierkv.quant.torch_batch import Received

                    received = [Received(len(ids), memory) for memory in self.received_memory()]
                    decode = functools.partial(self._receive, received, staged)
                else:
                    decode = functools.partial(_decode_runs, self._decode_targets(staged))
                written: set[int] = set()
                places = _Places(len(ids), self._head_bytes()) if placeable else None
                consume = (
                    functools.partial(self._write_lossless, ids, written, decode, places)
                    if direct
                    else decode
                )
                into = functools.partial(self._placing, ids, places) if places is not None else None
                bad = fetch(start, start + len(ids), consume, into)
                if received:
                    bad |= self._decode_received(received, staged)
                good = sorted(set(range(len(ids))) - bad - written)
                if self.real is not None and good:
                    self._from_real_axes(staged, good)
                self.scatter(staged, good, [ids[index] for index in good])
                failed.update(start + index for index in bad)
        finally:
            for staged in in_flight:
                staged.wait()
                staged.release()
        return failed

    def received_memory(self) -> list[HostMemory]:
        """Per part, the host memory the payloads of a device-decode batch are received in."""
        from tierkv.quant.torch_batch import HostMemory

        if not self._received_memory:
            pin = self.device.type == "cuda"
            self._received_memory = [HostMemory(pin=pin) for _ in self.parts]
        return self._received_memory

    def _decode_targets(self, staged: Staged) -> list[np.ndarray]:
        """Per part, the host arrays a batch decodes into: the staging, or with real axes a
        buffer of blocks in those (`_from_real_axes` puts them into the staging)."""
        arrays = staged.arrays()
        if self.real is None:
            return arrays
        real = np.empty((staged.count, *self.real.real_shape(self.shapes[0])), arrays[0].dtype)
        staged.keep_host = real
        return [real]

    def _from_real_axes(self, staged: Staged, slots: list[int]) -> None:
        """Put decoded slots `slots` of a real-axes batch into its staging, in the nominal
        layout the engine's kernel reads."""
        assert self.real is not None and staged.keep_host is not None
        at = np.asarray(slots, dtype=np.int64)
        numpy_words(staged.tensors[0])[at] = self.real.from_real_axes(staged.keep_host[at])

    def _placeable(self) -> bool:
        """Whether every layer of this one-part host mover is contiguous, blocks first (a
        lossless payload's body can then be received straight into its block, layer by
        layer)."""
        assert self._host_layers is not None
        return all(layer.flags.c_contiguous for layer in self._host_layers[0])

    def _head_bytes(self) -> int:
        """Header bytes of a lossless payload of this one-part mover's block."""
        from tierkv.quant.payload import header_bytes

        return header_bytes(len(self.shapes[0]))

    def _placing(
        self,
        block_ids: Sequence[int],
        places: _Places,
        indices: Sequence[int],
        parts: Sequence[int],
    ) -> dict[tuple[int, int], list[memoryview]]:
        """`into` of a load batch: for each block, its header's row in `places` and engine
        block `block_ids[index]` of every layer, in payload order (so only a lossless payload
        fits them; the row is remembered, so `_write_lossless` knows which were placed)."""
        assert self._host_layers is not None
        if 0 not in parts:
            return {}
        head_bytes = places.heads.shape[1]
        layer_bytes = self.part_bytes(0) // len(self._host_layers[0])
        heads = places.heads.data.cast("B")
        starts = [block_ids[index] * layer_bytes for index in indices]
        columns = [[heads[index * head_bytes : (index + 1) * head_bytes] for index in indices]]
        for layer in self._host_layers[0]:
            view = layer.data.cast("B")
            columns.append([view[start : start + layer_bytes] for start in starts])
        places.rows.update(zip(indices, columns[0], strict=True))
        return {
            (index, 0): list(bufs)
            for index, bufs in zip(indices, zip(*columns, strict=True), strict=True)
        }

    def _write_lossless(
        self,
        block_ids: Sequence[int],
        written: set[int],
        decode: Consume,
        places: _Places | None,
        blocks: list[Block],
    ) -> set[int]:
        """consume of a host load: payloads placed in their engine blocks checked (`places`),
        other lossless payloads copied straight into engine blocks `block_ids[i]`, the rest
        `decode`d into the batch's staging; the indices that failed. The restored indices
        written in place are added to `written`."""
        failed: set[int] = set()
        if places is not None:
            placed = [index for index, _, payload in blocks if places.rows.get(index) is payload]
            failed = self._check_placed(places, placed)
            written.update(set(placed) - failed)
            if len(placed) == len(blocks):
                blocks = []
            else:
                blocks = [block for block in blocks if places.rows.get(block[0]) is not block[2]]
        lossy = blocks and self._lossless(blocks[0][2]) is False  # the tier's codec, surely
        rest = blocks if lossy else self._scatter_lossless(block_ids, blocks)
        written.update({index for index, _, _ in blocks} - {index for index, _, _ in rest})
        return failed | (decode(rest) if rest else set())

    def _check_placed(self, places: _Places, indices: list[int]) -> set[int]:
        """The `indices` whose placed payload's header is not a lossless one of this block
        (their engine blocks hold whatever arrived: they must be reported failed). Headers equal
        to the first one's share its verdict."""
        if not indices:
            return set()
        every = len(indices) == len(places.heads)  # (indices are distinct)
        at = np.arange(len(indices)) if every else np.asarray(indices, dtype=np.int64)
        rows = places.heads if every else places.heads[at]
        same = (rows == rows[0]).all(axis=1)
        ok = same & self._lossless_header(rows[0])
        for row in np.flatnonzero(~same):
            ok[row] = self._lossless_header(rows[row])
        return set(at[~ok].tolist())

    def _lossless_header(self, head: np.ndarray) -> bool:
        """Whether `head` is the header of a lossless payload of this one-part mover's block
        (remembered per header: a load's headers are nearly always the same one)."""
        key = head.tobytes()
        verdict = self._header_verdicts.get(key)
        if verdict is None:
            payload = np.zeros(len(head) + self.part_bytes(0), dtype=np.uint8)
            payload[: len(head)] = head
            verdict = self._lossless(payload.data) is True
            if len(self._header_verdicts) >= _HEADER_VERDICTS:
                self._header_verdicts.clear()
            self._header_verdicts[key] = verdict
        return verdict

    def _scatter_lossless(self, block_ids: Sequence[int], blocks: list[Block]) -> list[Block]:
        """Copy lossless payloads of this one-part mover straight into the engine blocks; the
        blocks it did not handle (another codec or shape, a header that does not validate).

        Payloads received back to back (one receive buffer, one length) are one strided array,
        [n, length]; past their headers it is [n, layers, *block], and one indexed copy per
        layer writes the whole run. A run starts at a payload whose header validates as codec
        none of this part's dtype and element count, and takes only the payloads whose header
        bytes equal that one.
        """
        from tierkv.quant.payload import back_to_back_runs

        assert self._host_layers is not None
        layers = self._host_layers[0]
        rest: list[Block] = []
        for span in back_to_back_runs([payload for _, _, payload in blocks]):
            run = blocks[span.start : span.stop]
            start = len(run)  # the first payload that validates decides for the run
            for at, block in enumerate(run):
                lossless = self._lossless(block[2])
                if lossless is not None:
                    start = at if lossless else len(run)
                    break
            rest.extend(run[:start])
            run = run[start:]
            if not run:
                continue
            first = run[0][2]
            head = len(first) - self.part_bytes(0)  # header bytes: the payload less its body
            rows = np.lib.stride_tricks.as_strided(
                np.frombuffer(first, np.uint8),
                (len(run), len(first)),
                (len(first), 1),
                writeable=False,
            )
            same = (rows[:, :head] == rows[0, :head]).all(axis=1)
            if not same.all():
                rest.extend(block for block, ok in zip(run, same, strict=True) if not ok)
                rows = rows[same]
            bodies = rows[:, head:].view(layers[0].dtype).reshape(len(rows), *self.shapes[0])
            ids = np.asarray(
                [block_ids[index] for (index, _, _), ok in zip(run, same, strict=True) if ok],
                dtype=np.int64,
            )
            for layer, array in enumerate(layers):
                array[ids] = bodies[:, layer]
        return rest

    def _lossless(self, payload: memoryview) -> bool | None:
        """Whether `payload` validates as codec none holding this one-part mover's block (None:
        it does not validate at all)."""
        from tierkv.quant import PayloadError
        from tierkv.quant.codec import checked_body

        try:
            header, _ = checked_body(payload)
        except PayloadError:
            return None
        wanted = ("none", self.codec_dtypes[0], self.shapes[0])
        return (header.codec, header.dtype, header.shape) == wanted

    def _receive(self, received: list[Received], staged: Staged, blocks: list[Block]) -> set[int]:
        """consume of a device-decode load: each payload copied into its part's host buffer
        for the batch's decode (`_decode_received`); one that does not fit is decoded now, by
        itself (one of another block shape fails there: `_check_shape`). The indices that
        failed so far."""
        from tierkv.load import decode_each

        rest = [
            block
            for block in blocks
            if not _shape_fits(block[2], tuple(staged.tensors[block[1]].shape[1:]))
            or not received[block[1]].add(block[0], block[2])
        ]
        if not rest:
            return set()
        return decode_each(rest, _slot_of(staged.tensors), self.decode_on_device)

    def _decode_received(self, received: list[Received], staged: Staged) -> set[int]:
        """Decode a batch's received payloads into its device staging, one batched decode per
        part on the load stream (tierkv.quant.torch_batch); the indices that failed. The host
        buffers are kept until the batch's copies have completed."""
        from tierkv.quant import PayloadError
        from tierkv.quant.torch_batch import decode_batch

        failed: set[int] = set()
        with _on_stream(self._load_stream):
            for part, batch in enumerate(received):
                bad, unhandled = decode_batch(batch, staged.tensors[part])
                failed |= bad
                for index in unhandled:  # format version 1 payloads: one by one
                    payload = batch.payload(index)
                    try:
                        self.decode_on_device(payload, staged.tensors[part][index])
                    except PayloadError:
                        failed.add(index)
                staged.keep.append(batch.data)
        return failed

    def decode_on_device(self, payload: memoryview, out: torch.Tensor) -> None:
        """Decode `payload` into device staging with tierkv.quant.torch_ops, on the load stream
        (so the scatter that follows on that stream sees it, and the engine's stream does not
        wait for it)."""
        from tierkv.quant import torch_ops

        _check_shape(payload, tuple(out.shape))
        with _on_stream(self._load_stream):
            torch_ops.decode_into(payload, out)

    def _scatter(
        self, sources: list[torch.Tensor], picked: torch.Tensor | None, ids: torch.Tensor
    ) -> None:
        for part, source in enumerate(sources):
            if picked is not None:
                source = source.index_select(0, picked.to(source.device))
            for layer, (tensor, dim) in enumerate(self.parts[part]):
                tensor.index_copy_(dim, ids, source.select(1, layer).movedim(0, dim))

    def _views(self, data: torch.Tensor, n: int) -> list[torch.Tensor]:
        """Per part, a [n, layers, *block] tensor over consecutive aligned spans of `data`."""
        views = []
        offset = 0
        for part, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes, strict=True)):
            nbytes = n * self.part_bytes(part)
            views.append(data[offset : offset + nbytes].view(dtype).view(n, *shape))
            offset += _aligned(nbytes)
        return views


def device_decode_pays(
    mover: BlockMover, encode: Callable[[np.ndarray], bytes]
) -> tuple[bool, str]:
    """Whether decoding on the device beats decoding on the host for this mover's blocks, and
    why (for the start-up log line): times one batch of up to 32 payloads, made by `encode` from
    the mover's first blocks (part 0), decoded both ways, the host way with the device copy of
    its result (best of 3 each)."""
    import time

    from tierkv.quant import decode_many
    from tierkv.quant.torch_batch import Received, decode_batch

    n = min(32, mover.parts[0][0][0].shape[mover.parts[0][0][1]])
    staged = mover.store(list(range(n)))
    if staged is None:
        return False, "no staging free to measure in; host decode"
    staged.wait()
    payloads = [encode(array) for array in staged.arrays()[0]]
    staged.release()
    host = mover.staging(n)
    device = mover.staging(n, on_device=True)
    times = {"host": float("inf"), "device": float("inf")}
    sync = torch.cuda.synchronize if mover.device.type == "cuda" else (lambda: None)
    for _ in range(3):
        started = time.perf_counter()
        decode_many([memoryview(p) for p in payloads], host.arrays()[0], list(range(n)))
        device.tensors[0].copy_(host.tensors[0])
        sync()
        times["host"] = min(times["host"], time.perf_counter() - started)
        started = time.perf_counter()
        received = Received(n, mover.received_memory()[0])
        for index, payload in enumerate(payloads):
            received.add(index, payload)
        decode_batch(received, device.tensors[0])
        sync()
        times["device"] = min(times["device"], time.perf_counter() - started)
    host.release()
    raw = n * mover.part_bytes(0)
    pays = times["device"] < times["host"]
    why = (
        f"decoding {n} blocks measured {raw / times['device'] / 1e9:.2f} GB/s on the device, "
        f"{raw / times['host'] / 1e9:.2f} GB/s on the host (with its copy to the device)"
    )
    return pays, why


def hand_over(staged: Staged, dtypes: Sequence[str], send: Send) -> None:
    """Wait until `staged` is complete, then `send(index, part, array, dtype, on_done)` every
    part of every block; the staging is released once each has called its on_done()."""
    staged.wait()
    arrays = staged.arrays()
    on_done = countdown(staged.count * len(arrays), staged.release)
    for index in range(staged.count):
        for part, array in enumerate(arrays):
            send(index, part, array[index], dtypes[part], on_done)


class _Places:
    """Where a load batch places lossless payloads: their headers' rows (`heads`, one per
    block), and the row views handed out so far (by block index)."""

    def __init__(self, blocks: int, head_bytes: int) -> None:
        self.heads = np.empty((blocks, head_bytes), dtype=np.uint8)
        self.rows: dict[int, memoryview] = {}


def _decode_runs(outputs: list[np.ndarray], blocks: list[Block]) -> set[int]:
    """Decode `blocks` into their slots of per-part host staging `outputs`; the indices that
    failed. Each part's blocks go to decode_many (a run of payloads received back to back is
    one kernel call, which gives the GIL back once, not once per block), the rest one by one.
    A payload of another block shape than its slot's fails (see `_check_shape`)."""
    from tierkv.load import decode_each
    from tierkv.quant import decode_many  # Numba: only once a load runs

    by_part: dict[int, list[Block]] = {}
    for block in blocks:
        by_part.setdefault(block[1], []).append(block)
    rest: list[Block] = []
    for part, group in by_part.items():
        shape = outputs[part].shape[1:]
        fits = [_shape_fits(payload, shape) for _, _, payload in group]
        fit = [block for block, ok in zip(group, fits, strict=True) if ok]
        rest.extend(block for block, ok in zip(group, fits, strict=True) if not ok)
        rows = [index for index, _, _ in fit]
        done = decode_many([payload for _, _, payload in fit], outputs[part], rows)
        rest.extend(block for block, ok in zip(fit, done, strict=True) if not ok)
    return decode_each(rest, _slot_of(outputs), _decode_checked) if rest else set()


def _shape_fits(payload: memoryview, shape: tuple[int, ...]) -> bool:
    from tierkv.quant import PayloadError, payload_shape

    try:
        return payload_shape(payload) == shape
    except PayloadError:
        return False


def _check_shape(payload: memoryview, shape: tuple[int, ...]) -> None:
    """PayloadError unless `payload` holds a block of `shape`. The decoders check only the
    element count, and a block of one count is stored in more than one shape (a lossy codec's
    block in its real axes, tierkv.real_axes): such a payload is a miss, never decoded into a
    wrong layout."""
    from tierkv.quant import PayloadError, payload_shape

    found = payload_shape(payload)
    if found != shape:
        raise PayloadError(f"payload holds a block of shape {found}, this engine's is {shape}")


def _decode_checked(payload: memoryview, out: np.ndarray) -> None:
    from tierkv.quant import decode_into

    _check_shape(payload, out.shape)
    decode_into(payload, out)


def _slot_of(outputs: list[Any]) -> Callable[[int, int], Any]:
    """out_for of a load: block `index`'s slot of part `part` in per-part staging outputs."""
    return lambda index, part: outputs[part][index]


def _on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
