"""The vault's memory: a byte-capped, thread-safe LRU of (namespace, key, part) → payload.

No gRPC here. Writers' checksums (`wire.block_checksum`, bound to the block's address) are
verified on `put` (a mismatch is rejected, never stored); payloads are hashed outside the lock,
which guards only the index and never a payload copy, so many clients can store and read at
once. `bytes_used` is exactly the sum of stored payload sizes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tierkv.config import UNLIMITED
from tierkv.vault.wire import block_checksum

EntryKey = tuple[bytes, bytes, int]
"""(namespace, block key, part)"""


class StoredBlock(NamedTuple):
    """One payload found by `VaultStore.get_many`."""

    key_index: int
    part: int
    payload: bytes | memoryview
    checksum: int


@dataclass(frozen=True)
class StoreStats:
    """Counters of a VaultStore; hits/misses count block parts asked of `get_many`."""

    entries: int
    bytes_used: int
    max_bytes: int
    hits: int
    misses: int
    evictions: int
    rejected: int


class VaultStore:
    """LRU by bytes: reads refresh, re-storing replaces, the least recently used go first."""

    def __init__(self, max_bytes: int = UNLIMITED) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 = unlimited), got {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[EntryKey, tuple[bytes | memoryview, int]] = OrderedDict()
        self._parts: dict[tuple[bytes, bytes], set[int]] = {}
        self._bytes_used = 0
        self._hits = self._misses = self._evictions = self._rejected = 0

    def put(
        self, namespace: bytes, key: bytes, part: int, payload: bytes | memoryview, checksum: int
    ) -> str | None:
        """Store `payload` as given; None when stored, else the reason it was rejected.

        The store keeps a reference, not a copy: a memoryview must view an immutable buffer
        (the server passes views of received messages).
        """
        size = len(payload)
        reason = None
        if self.max_bytes != UNLIMITED and size > self.max_bytes:
            reason = f"payload of {size} bytes exceeds the vault cap of {self.max_bytes} bytes"
        elif block_checksum(namespace, key, part, payload) != checksum:
            reason = "checksum mismatch: payload corrupted in transit or sent under another key"
        if reason is not None:
            with self._lock:
                self._rejected += 1
            return reason
        with self._lock:
            self._remove((namespace, key, part))
            self._entries[(namespace, key, part)] = (payload, checksum)
            self._parts.setdefault((namespace, key), set()).add(part)
            self._bytes_used += size
            while self.max_bytes != UNLIMITED and self._bytes_used > self.max_bytes:
                self._remove(next(iter(self._entries)))
                self._evictions += 1
        return None

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        """How many leading keys have every one of `parts` stored (no LRU refresh)."""
        with self._lock:
            for count, key in enumerate(keys):
                present = self._parts.get((namespace, key), ())
                if not all(part in present for part in parts):
                    return count
        return len(keys)

    def get_many(
        self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]
    ) -> list[StoredBlock]:
        """Every stored (key, part) of the request, in request order; each read refreshes it."""
        found = []
        with self._lock:
            for index, key in enumerate(keys):
                for part in parts:
                    entry_key = (namespace, key, part)
                    entry = self._entries.get(entry_key)
                    if entry is None:
                        self._misses += 1
                        continue
                    self._entries.move_to_end(entry_key)
                    self._hits += 1
                    found.append(StoredBlock(index, part, entry[0], entry[1]))
        return found

    def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Remove every part of the given keys; returns how many (key, part) entries went."""
        with self._lock:
            removed = 0
            for key in keys:
                for part in list(self._parts.get((namespace, key), ())):
                    self._remove((namespace, key, part))
                    removed += 1
            return removed

    def clear(self, namespace: bytes) -> int:
        """Remove everything stored under `namespace`; returns how many entries went."""
        with self._lock:
            doomed = [entry_key for entry_key in self._entries if entry_key[0] == namespace]
            for entry_key in doomed:
                self._remove(entry_key)
            return len(doomed)

    def stats(self) -> StoreStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return StoreStats(
                entries=len(self._entries),
                bytes_used=self._bytes_used,
                max_bytes=self.max_bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                rejected=self._rejected,
            )

    def _remove(self, entry_key: EntryKey) -> None:
        """Drop one entry if present; the caller holds the lock."""
        entry = self._entries.pop(entry_key, None)
        if entry is None:
            return
        self._bytes_used -= len(entry[0])
        namespace, key, part = entry_key
        parts = self._parts[(namespace, key)]
        parts.discard(part)
        if not parts:
            del self._parts[(namespace, key)]
