"""The vault's memory: a byte-capped, thread-safe LRU of (namespace, key, part) → payload.

No gRPC here. Writers' checksums (`wire.block_checksum`, bound to the block's address) are
verified on `put` (a mismatch is rejected, never stored); payloads are hashed outside the lock,
which guards only the index and never a payload copy, so many clients can store and read at
once. `bytes_used` is exactly the sum of stored payload sizes.

With a `DiskTier` (disk.py) the store is its RAM tier: every stored block is also queued for the
disk (written behind, so a put waits only when the write-behind queue is full), RAM evictions
keep the disk copy (spilling the block if the disk has none), and lookups and reads fall through
to the disk; a block read from disk is brought back into RAM as the most recently used.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tierkv.config import UNLIMITED
from tierkv.vault.disk import DiskStats, DiskTier
from tierkv.vault.wire import block_checksum

RATE_WINDOW_S = 10.0

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
    """Counters of a VaultStore; hits/misses count block parts asked of `get_many`.

    entries, bytes_used, max_bytes and evictions are the RAM tier's; hits counts both tiers,
    ram_hits / disk_hits each, and *_reads_per_s the hits per second over the last 10 s.
    """

    entries: int
    bytes_used: int
    max_bytes: int
    hits: int
    misses: int
    evictions: int
    rejected: int
    ram_hits: int = 0
    ram_reads_per_s: float = 0.0
    disk_hits: int = 0
    disk_reads_per_s: float = 0.0
    disk: DiskStats | None = None


class _Rate:
    """Events per second over the last RATE_WINDOW_S seconds."""

    def __init__(self) -> None:
        self._events: deque[tuple[float, int]] = deque()

    def add(self, count: int) -> None:
        if count:
            self._events.append((time.monotonic(), count))

    def per_second(self) -> float:
        horizon = time.monotonic() - RATE_WINDOW_S
        while self._events and self._events[0][0] < horizon:
            self._events.popleft()
        return sum(count for _, count in self._events) / RATE_WINDOW_S


class VaultStore:
    """LRU by bytes: reads refresh, re-storing replaces, the least recently used go first."""

    def __init__(self, max_bytes: int = UNLIMITED, disk: DiskTier | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 = unlimited), got {max_bytes}")
        self.max_bytes = max_bytes
        self.disk = disk
        self._disk_hits = 0
        self._ram_rate, self._disk_rate = _Rate(), _Rate()
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
            self._insert((namespace, key, part), payload, checksum)
            if self.disk:
                self.disk.write(namespace, key, part, payload, checksum)
        if self.disk:
            self.disk.wait_for_room()
        return None

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        """How many leading keys have every one of `parts` stored (no LRU refresh)."""
        with self._lock:
            for count, key in enumerate(keys):
                present = self._parts.get((namespace, key), ())
                missing = [part for part in parts if part not in present]
                if missing and not (self.disk and self.disk.has(namespace, key, missing)):
                    return count
        return len(keys)

    def get_many(
        self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]
    ) -> list[StoredBlock]:
        """Every stored (key, part) of the request, in request order; each read refreshes it.

        Blocks absent from RAM are read from the disk tier (outside the lock) and kept in RAM.
        """
        found = []
        absent: list[tuple[int, int]] = []
        with self._lock:
            for index, key in enumerate(keys):
                for part in parts:
                    entry_key = (namespace, key, part)
                    entry = self._entries.get(entry_key)
                    if entry is None:
                        absent.append((index, part))
                        continue
                    self._entries.move_to_end(entry_key)
                    self._hits += 1
                    found.append(StoredBlock(index, part, entry[0], entry[1]))
            self._ram_rate.add(len(found))
        if not absent or self.disk is None:
            with self._lock:
                self._misses += len(absent)
            return found
        read = self.disk.read_many(namespace, [(keys[i], part) for i, part in absent])
        with self._lock:
            for (index, part), block in zip(absent, read, strict=True):
                if block is None:
                    self._misses += 1
                    continue
                entry_key = (namespace, keys[index], part)
                fits = self.max_bytes == UNLIMITED or len(block[0]) <= self.max_bytes
                if fits and entry_key not in self._entries:
                    self._insert(entry_key, *block)
                found.append(StoredBlock(index, part, *block))
                self._hits += 1
                self._disk_hits += 1
                self._disk_rate.add(1)
        order = {part: position for position, part in enumerate(parts)}
        found.sort(key=lambda block: (block.key_index, order[block.part]))
        return found

    def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Remove every part of the given keys; returns how many (key, part) entries went."""
        with self._lock:
            removed = {
                (namespace, key, part)
                for key in keys
                for part in self._parts.get((namespace, key), ())
            }
            for entry_key in removed:
                self._remove(entry_key)
            if self.disk:
                removed |= self.disk.delete(namespace, keys)
            return len(removed)

    def clear(self, namespace: bytes) -> int:
        """Remove everything stored under `namespace`; returns how many entries went."""
        with self._lock:
            doomed = {entry_key for entry_key in self._entries if entry_key[0] == namespace}
            for entry_key in doomed:
                self._remove(entry_key)
            if self.disk:
                doomed |= self.disk.clear(namespace)
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
                ram_hits=self._hits - self._disk_hits,
                ram_reads_per_s=self._ram_rate.per_second(),
                disk_hits=self._disk_hits,
                disk_reads_per_s=self._disk_rate.per_second(),
                disk=self.disk.stats() if self.disk else None,
            )

    def close(self, timeout: float | None = None) -> int:
        """Spill every RAM-only block to the disk tier and close it, within `timeout` seconds.

        Returns how many blocks did not reach the disk (0 without a disk tier).
        """
        if self.disk is None:
            return 0
        with self._lock:
            for (namespace, key, part), (payload, checksum) in self._entries.items():
                self.disk.spill(namespace, key, part, payload, checksum)
        return self.disk.close(timeout)

    def _insert(self, entry_key: EntryKey, payload: bytes | memoryview, checksum: int) -> None:
        """Store one entry as the most recent, evicting (spilling) the least recent past the cap;
        the caller holds the lock."""
        self._remove(entry_key)
        self._entries[entry_key] = (payload, checksum)
        self._parts.setdefault(entry_key[:2], set()).add(entry_key[2])
        self._bytes_used += len(payload)
        while self.max_bytes != UNLIMITED and self._bytes_used > self.max_bytes:
            victim = next(iter(self._entries))
            if self.disk:
                self.disk.spill(*victim, *self._entries[victim])
            self._remove(victim)
            self._evictions += 1

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
