"""Keep freed memory in the process for reuse, so the blocks a tier encodes and restores are
written into pages already mapped.

glibc hands a freed allocation above its mmap threshold back to the kernel at once, and gives an
arena's free memory back once more than its trim threshold of it is free (both 128 KiB at start,
raised only as far as the largest block freed so far), keeping none. A tier's threads make and
free payloads of MiBs by the hundred (a put queue holds up to `[client] max_pending_bytes`), so
each batch landed in fresh memory: a page fault per 4 KiB page and the kernel zeroing it, which
in a VM took int8 encoding from 0.6x of memcpy into reused memory to 0.3x. `keep_freed_memory`
fixes the thresholds and the top pad (glibc's `mallopt`): allocations up to the mmap threshold
come from the arenas, and an arena that gives memory back keeps `kept_bytes` of it free for the
next ones. The cost is resident memory after a burst: an arena keeps that much, plus any freed
memory not at its top, which glibc never returns. Another C library (macOS, musl) is left as
it is.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

from tierkv.sizes import MIB

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 * MIB
"""The largest mmap threshold glibc accepts on 64-bit (half its 64 MiB arena heap); a larger
allocation is mapped afresh whatever is set."""


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None under another C library (which has none)."""
    function = getattr(ctypes.CDLL(None), "mallopt", None)
    if function is not None:
        function.argtypes = (ctypes.c_int, ctypes.c_int)
        function.restype = ctypes.c_int
    return function


def keep_freed_memory(kept_bytes: int) -> bool:
    """Let each malloc arena of this process keep `kept_bytes` of freed memory mapped when it
    gives memory back, and serve allocations up to min(`kept_bytes`, MAX_MMAP_THRESHOLD) from
    the arenas (process-wide; the last call wins). 0 leaves the C library's defaults. True when
    glibc took every setting."""
    mallopt = _mallopt()
    if kept_bytes <= 0 or mallopt is None:
        return False
    kept = min(kept_bytes, 2**31 - 1)  # mallopt takes an int
    settings = {
        M_MMAP_THRESHOLD: min(kept, MAX_MMAP_THRESHOLD),
        M_TRIM_THRESHOLD: kept,
        M_TOP_PAD: kept,
    }
    return all([mallopt(option, value) for option, value in settings.items()])
