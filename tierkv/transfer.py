"""How promoted payloads are received and handed on, shared by every backend and the tier.

`Into` is how a caller offers its own buffers for a Promote; `RECEIVE_BUFFERS` is the
process's pool of receive buffers (already mapped, huge-page aligned) that the vault's bulk
client, the tier and the seal's opened copies take runs from, filled and touched when a tier
starts (`ReceiveBuffers.fill`, `[client] receive_pool_bytes`) so no restore pays a page fault;
`batched_by_size` cuts a stream of blocks into runs of about a size.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TypeVar

import numpy as np

from tierkv.sizes import MIB

ItemT = TypeVar("ItemT")

Into = Callable[[Sequence[int], Sequence[int]], dict[tuple[int, int], list[memoryview]]]
"""into(key indices, parts) -> by (key index, part), the writable buffers a promoted payload of
that block is received straight into, in order; a block not given, or whose buffers do not add
up to its payload's length, goes into the client's own (a vault's bulk path:
backends.vault_bulk.BulkConnection.promote)."""
CLIENT_RUN_BYTES = 8 * MIB
"""The client receives promoted payloads into buffers of this size (a larger payload: its own)."""
MAX_POOLED_BYTES = 1024 * MIB
"""The client keeps at most this many bytes of receive buffers for reuse (per process)."""
HUGE_PAGE_BYTES = 2 * MIB


def _huge_page_aligned(size: int) -> np.ndarray:
    """Zeroed, untouched bytes starting on a 2 MiB boundary, in an anonymous mapping of their own
    advised for huge pages, so huge pages can back all of them. Not from malloc: with freed
    memory kept (tierkv.heap) malloc serves requests up to 32 MiB from its heap, where a fresh
    buffer came in 4 KiB pages now and then (about 500 faults in a restore, against 4)."""
    # Private: a shared anonymous mapping is shmem, which transparent huge pages leave alone.
    area = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(area, dtype=np.uint8)  # keeps the mapping alive as long as any view
    start = -raw.ctypes.data % HUGE_PAGE_BYTES
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE (macOS) or refused
        area.madvise(mmap.MADV_HUGEPAGE, start, size)
    return raw[start : start + size]


class ReceiveBuffers:
    """Fixed-size receive buffers, each reused once no payload view of it is alive any more.

    Fresh memory costs a page fault per page and, below 4 MiB, comes in 4 KiB pages that a VM
    walks slowly; pooled buffers are already mapped and aligned to whole huge pages, advised for
    them (`_huge_page_aligned`). A buffer is free when only the pool refers to it: every view
    the caller was given has been released.
    """

    def __init__(self, buffer_bytes: int, max_bytes: int) -> None:
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max_bytes // buffer_bytes
        self._lock = threading.Lock()
        self._buffers: list[np.ndarray] = []

    def take(self) -> np.ndarray:
        """A buffer of `buffer_bytes` that nobody else uses (pooled when the pool has room)."""
        with self._lock:
            for buf in self._buffers:
                # References: the pool's list, this loop's name and getrefcount's argument.
                if sys.getrefcount(buf) == 3:
                    return buf
            buf = _huge_page_aligned(self.buffer_bytes)
            if len(self._buffers) < self.max_buffers:
                self._buffers.append(buf)
            return buf

    def fill(self, total_bytes: int) -> int:
        """Map and touch (write every page of) new buffers until the pool holds `total_bytes`
        (at most its cap, whole buffers), so the restores that take them fault no page in: the
        kernel zeroes each page at its first touch, which in a VM runs a receive at a fraction
        of memcpy's speed. Returns the bytes the pool holds."""
        with self._lock:
            wanted = min(-(-total_bytes // self.buffer_bytes), self.max_buffers)
            while len(self._buffers) < wanted:
                buf = _huge_page_aligned(self.buffer_bytes)
                buf.fill(0)
                self._buffers.append(buf)
            return len(self._buffers) * self.buffer_bytes


RECEIVE_BUFFERS = ReceiveBuffers(CLIENT_RUN_BYTES, MAX_POOLED_BYTES)


def batched_by_size(
    items: Iterable[ItemT],
    size_of: Callable[[ItemT], int],
    max_bytes: int,
    group_of: Callable[[ItemT], Hashable] | None = None,
    max_items: int = sys.maxsize,
) -> Iterator[list[ItemT]]:
    """Consecutive runs of `items` (of one `group_of`, when given), each about `max_bytes` (an
    oversize item alone) and of at most `max_items`. One call of each function per item: this
    runs once per block on a restore's path."""
    batch: list[ItemT] = []
    size = 0
    group: Hashable = None
    for item in items:
        item_size = size_of(item)
        item_group = group_of(item) if group_of is not None else None
        if batch and (
            size + item_size > max_bytes or len(batch) >= max_items or item_group != group
        ):
            yield batch
            batch, size = [], 0
        if not batch:
            group = item_group
        batch.append(item)
        size += item_size
    if batch:
        yield batch
