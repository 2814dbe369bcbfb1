"""Make this process reuse freed payload memory instead of returning it to the kernel (glibc).

By default glibc serves every allocation over 128 KiB from a fresh mmap and unmaps it on free, so
each payload-sized buffer (a stored payload, a gRPC message) is page-faulted in, 4 KiB at a time,
every time. Moving gigabytes of payloads that way is bound by page faults (about half the cost
of a Promote on a small VM). After `reuse_freed_memory()` such buffers come from the heap and
freed ones are reused; the price is that the process keeps its peak heap instead of shrinking.
`tierkv vault` calls it at start-up; an engine process may opt in.
"""

from __future__ import annotations

import ctypes
import sys

from tierkv.config import MIB

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * MIB
"""Allocations up to this size come from the heap (glibc's documented maximum on 64-bit)."""
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Free heap kept before glibc returns memory to the kernel (the largest value mallopt takes)."""


def reuse_freed_memory() -> bool:
    """Tune glibc's malloc for this process; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already uses
    except (OSError, AttributeError):
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
