"""The checksum every payload travels and is stored with, on every backend and both vault paths.

xxh3_64 seeded with the block's address (namespace, key, part): a payload filed or returned under
another address fails its check exactly like a corrupted one. Unkeyed: it catches damage and
misfiling, not forgery (sealed blocks carry an AEAD tag for that, seal.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache

import xxhash

HOLDING_GIL_BYTES = 64 * 1024
"""xxhash gives the GIL back while it hashes more than this in one call."""


def block_checksum(
    namespace: bytes,
    key: bytes,
    part: int,
    payload: bytes | memoryview,
    *more: bytes | memoryview,
    hold_gil: bool = False,
) -> int:
    """The checksum a payload travels and is stored with: xxh3_64 of the payload, seeded with
    its address, so a payload filed or returned under another (namespace, key, part) fails its
    check exactly like a corrupted one. A payload received in pieces: `payload, *more`.

    `hold_gil` (in an engine's process) hashes in slices of HOLDING_GIL_BYTES, so the GIL is
    never given back: each time it is, a thread busy in Python may keep it for a switch
    interval (5 ms), per block. A vault gives it back, so its other threads run meanwhile."""
    return checksum_at(address_prefix(namespace, part) + key, (payload, *more), hold_gil)


def checksum_at(
    address: bytes, pieces: Sequence[bytes | memoryview], hold_gil: bool = False
) -> int:
    """block_checksum of the payload in `pieces` at `address`, which is
    `address_prefix(namespace, part) + key` (a caller checking many blocks of a part makes the
    prefix once)."""
    seed = xxhash.xxh3_64_intdigest(address)
    if len(pieces) == 1 and (not hold_gil or len(pieces[0]) <= HOLDING_GIL_BYTES):
        return xxhash.xxh3_64_intdigest(pieces[0], seed=seed)
    hasher = xxhash.xxh3_64(seed=seed)
    for piece in pieces:
        if not hold_gil or len(piece) <= HOLDING_GIL_BYTES:
            hasher.update(piece)
            continue
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), HOLDING_GIL_BYTES):
            hasher.update(view[start : start + HOLDING_GIL_BYTES])
    return hasher.intdigest()


@lru_cache(maxsize=256)
def address_prefix(namespace: bytes, part: int) -> bytes:
    """What a block's address starts with: the same for every key of a namespace's part."""
    return struct.pack("<II", len(namespace), part) + namespace
