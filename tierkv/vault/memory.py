"""Tune the vault process's memory management for moving gigabytes of payload-sized buffers:
huge pages for glibc's heap and Python's garbage collector (glibc's malloc itself is tuned by
tierkv.heap.reuse_freed_memory).

Huge pages matter: in a virtual machine, walking 4 KiB pages costs so much that hashing
or copying a payload in 4 KiB-page memory runs at a tenth of the speed of the same bytes in
transparent huge pages. glibc backs its heap with huge pages only when the tunable
`glibc.malloc.hugetlb=1` is in the environment at process start, so `restart_with_huge_pages()`
re-executes the process with it.

Python's cyclic garbage collector pauses every thread of the process while a full collection
visits each tracked object. The vault's stored blocks are kept in untracked objects, so what a
full collection visits is mostly what start-up made: about 47k objects (modules, gRPC), a 15-35 ms
pause here every few hundred Promotes, which each client waiting on the vault then waits too.
`freeze_startup_objects()` moves those out of the collector's sight once the vault is serving.
`tierkv vault` calls these and `reuse_freed_memory` at start-up.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Mapping

from tierkv.heap import is_glibc_linux

HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"
"""glibc tunable: madvise the malloc heap for transparent huge pages (glibc 2.35 and newer)."""


def _sets_huge_pages(env: Mapping[str, str]) -> bool:
    """Whether `env`'s GLIBC_TUNABLES already decides the huge-page tunable (either way)."""
    return "glibc.malloc.hugetlb=" in env.get("GLIBC_TUNABLES", "")


def with_huge_pages(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` whose GLIBC_TUNABLES also asks for a huge-page malloc heap."""
    if _sets_huge_pages(env):
        return dict(env)
    tunables = env.get("GLIBC_TUNABLES", "")
    return {**env, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, HUGE_PAGE_TUNABLE]))}


def restart_with_huge_pages() -> None:
    """Re-execute this process (same pid, arguments and descriptors) with the huge-page tunable.

    Returns at once where it is set already (also after the restart) or the C library is not
    glibc; call it first thing, before threads start or output is buffered.
    """
    if not is_glibc_linux() or _sets_huge_pages(os.environ):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], with_huge_pages(os.environ))


def freeze_startup_objects() -> None:
    """Collect once, then exempt every object alive now from later collections (gc.freeze):
    call it once the process has started what it keeps for its lifetime. Frozen objects are
    still freed by reference counting when they go; only garbage cycles among them would stay."""
    gc.collect()
    gc.freeze()
