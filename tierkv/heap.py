"""glibc's malloc tuned for a process that makes and frees payload-sized buffers by the hundred:
freed memory kept in the process for reuse, so payloads are written into pages already mapped.

glibc hands a freed allocation above its mmap threshold back to the kernel at once, and gives an
arena's free memory back once more than its trim threshold of it is free (both 128 KiB at start,
raised only as far as the largest block freed so far), keeping none; a thread's arena also unmaps
each of its 64 MiB heaps that falls empty. So each batch of payloads landed in fresh memory: a
page fault per 4 KiB page and the kernel zeroing it, which in a VM took int8 encoding from 0.6x
of memcpy into reused memory to 0.3x. Two policies (both process-wide, through `mallopt`; the
last call wins; another C library, macOS's or musl, is left as it is):

- `keep_freed_memory(kept_bytes)`, an engine's tier: allocations up to the mmap threshold come
  from the arenas, and an arena that gives memory back keeps `kept_bytes` of it free (the top
  pad: it also keeps a thread's emptied heaps). Threads keep their own arenas (an engine has many).
- `reuse_freed_memory()`, the vault: every thread on the main heap (one arena: glibc madvises
  only that heap for huge pages, see tierkv.vault.memory) and nothing given back below 2 GiB free.

The cost is resident memory after a burst: what is kept, plus freed memory not at an arena's top,
which glibc never returns.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys
from collections.abc import Callable

from tierkv.sizes import MIB

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MAX_MMAP_THRESHOLD = 32 * MIB
"""The largest mmap threshold glibc accepts on 64-bit (half its 64 MiB arena heap); a larger
allocation is mapped afresh whatever is set."""
MAX_SETTING = 2**31 - 1
"""The largest value mallopt takes (an int)."""


def is_glibc_linux() -> bool:
    """Whether this process runs on Linux with glibc (whose malloc these settings tune)."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None under another C library."""
    if not is_glibc_linux():
        return None
    function = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library already loaded
    if function is not None:
        function.argtypes = (ctypes.c_int, ctypes.c_int)
        function.restype = ctypes.c_int
    return function


def _set(settings: dict[int, int]) -> bool:
    """mallopt each (option, value) of `settings`; True when glibc took every one."""
    mallopt = _mallopt()
    return mallopt is not None and all(
        [mallopt(option, value) for option, value in settings.items()]
    )


def keep_freed_memory(kept_bytes: int) -> bool:
    """Let each malloc arena of this process keep `kept_bytes` of freed memory mapped when it
    gives memory back, and serve allocations up to min(`kept_bytes`, MAX_MMAP_THRESHOLD) from
    the arenas. 0 leaves the C library's defaults. True when glibc took every setting."""
    if kept_bytes <= 0:
        return False
    kept = min(kept_bytes, MAX_SETTING)
    return _set(
        {M_MMAP_THRESHOLD: min(kept, MAX_MMAP_THRESHOLD), M_TRIM_THRESHOLD: kept, M_TOP_PAD: kept}
    )


def reuse_freed_memory() -> bool:
    """The vault's policy: one arena, allocations up to MAX_MMAP_THRESHOLD from it, freed memory
    given back only past MAX_SETTING bytes free. False where the C library is not glibc."""
    return _set(
        {M_MMAP_THRESHOLD: MAX_MMAP_THRESHOLD, M_TRIM_THRESHOLD: MAX_SETTING, M_ARENA_MAX: 1}
    )
