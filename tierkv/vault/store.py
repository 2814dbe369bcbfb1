"""The vault's memory: a byte-capped, thread-safe LRU of (namespace, key, part) → payload.

No gRPC here. Writers' checksums (`checksum.block_checksum`, bound to the block's address) are
verified on `put` (a mismatch is rejected, never stored); payloads are hashed outside the lock,
which guards only the index and never a payload copy, so many clients can store and read at
once, and a big request takes the lock in slices of LOCK_SLICE (key, part) steps, so it never
holds it long. `bytes_used` counts each entry's payload, key, namespace and bookkeeping
(`entry_bytes`), so it bounds the memory the RAM tier's entries take, however small their
payloads.

Tenants: given `tenant_of` (namespace → its tenant; a vault of several tenants), the store
evicts the least recently used entry of the tenant holding the most bytes, so a tenant within its
fair share (cap / tenants holding blocks) never loses a block to another tenant's flood; without
it (one tenant) eviction is plain LRU. A disk tier is told the tenants too (`DiskTier.share_by`)
and keeps the same share on disk.

With a `DiskTier` (disk.py) the store is its RAM tier: every stored block is also queued for the
disk (written behind, so a put waits only when the write-behind queue is full; `wait_durable`
tells the server when the blocks it stored are on disk), RAM evictions keep the disk copy
(spilling the block if the disk has none), and lookups and reads fall through to the disk; a
block read from disk is brought back into RAM as the most recently used, and a block read from
RAM is marked read on disk too, so the disk's eviction keeps it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import NamedTuple

from tierkv.checksum import block_checksum
from tierkv.config import UNLIMITED
from tierkv.vault.disk import DiskStats, DiskTier

RATE_WINDOW_S = 10.0
DURABLE_WAIT_S = 30.0
"""Longest a Put batch waits for the disk tier to write it before it is refused."""

EntryKey = tuple[bytes, bytes, int]
"""(namespace, block key, part)"""
ENTRY_OVERHEAD_BYTES = 1024
"""Memory an entry takes besides its payload, key and namespace bytes: its index, dicts and
objects (about 630 bytes by tracemalloc) and the allocator's slack after the store has churned
(a vault of one-byte blocks grew by about 1 KiB per entry)."""
LOCK_SLICE = 1024
"""(key, part) steps of one request done per hold of the store lock."""


def entry_bytes(namespace: bytes, key: bytes, size: int) -> int:
    """What an entry of a `size`-byte payload counts against the cap."""
    return size + len(key) + len(namespace) + ENTRY_OVERHEAD_BYTES


class StoredBlock(NamedTuple):
    """One payload found by `VaultStore.get_many`."""

    key_index: int
    part: int
    payload: bytes | memoryview
    checksum: int


@dataclass
class _Namespace:
    """The RAM tier's (key → parts) of one namespace."""

    parts: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    """Tuples, not sets: a tuple of ints is not tracked by Python's cyclic garbage collector
    (a set always is), and a full collection visits every tracked object, so a set per key
    made it pause the vault for about 0.4 ms per thousand keys stored (110 ms at 300k)."""


@dataclass
class _TenantLRU:
    """One tenant's entries, least recently used first, and the bytes they count."""

    order: OrderedDict[EntryKey, None] = field(default_factory=OrderedDict)
    bytes_used: int = 0


@dataclass(frozen=True)
class StoreStats:
    """Counters of a VaultStore; hits/misses count block parts asked of `get_many`.

    entries, bytes_used, payload_bytes (bytes_used less keys, namespaces and bookkeeping),
    max_bytes and evictions are the RAM tier's; hits counts both tiers,
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
    payload_bytes: int = 0


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

    def __init__(
        self,
        max_bytes: int = UNLIMITED,
        disk: DiskTier | None = None,
        tenant_of: Callable[[bytes], bytes] | None = None,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 = unlimited), got {max_bytes}")
        self.max_bytes = max_bytes
        self.disk = disk
        self._disk_hits = 0
        self._ram_rate, self._disk_rate = _Rate(), _Rate()
        self._lock = threading.Lock()
        self._entries: OrderedDict[EntryKey, tuple[bytes | memoryview, int]] = OrderedDict()
        self._namespaces: dict[bytes, _Namespace] = {}
        self._tenant_of = tenant_of
        if disk is not None and tenant_of is not None:
            disk.share_by(tenant_of)
        self._tenants: dict[bytes, _TenantLRU] = {}
        """tenant → its entries, with `tenant_of` only."""
        self._tenant_evictions: dict[bytes, int] = {}
        """tenant → how many of its entries were evicted, with `tenant_of` only."""
        self._bytes_used = self._payload_bytes = 0
        self._hits = self._misses = self._evictions = self._rejected = 0

    def put(
        self, namespace: bytes, key: bytes, part: int, payload: bytes | memoryview, checksum: int
    ) -> str | None:
        """Store `payload` as given; None when stored, else the reason it was rejected.

        The store keeps a reference, not a copy: a memoryview must view an immutable buffer
        (the server passes views of received messages).
        """
        size = entry_bytes(namespace, key, len(payload))
        reason = None
        if self.max_bytes != UNLIMITED and size > self.max_bytes:
            reason = f"entry of {size} bytes exceeds the vault cap of {self.max_bytes} bytes"
        elif self.disk and not self.disk.record_fits(namespace, key, len(payload)):
            reason = (
                f"block of {len(payload)} bytes never fits the disk tier "
                f"({self.disk.room} bytes of records)"
            )
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
        """How many leading keys have every one of `parts` stored (no LRU refresh); 0 when
        `parts` is empty (a block of no parts is nothing stored)."""
        if not parts:
            return 0
        step = max(1, LOCK_SLICE // len(parts))
        for start in range(0, len(keys), step):
            with self._lock:
                space = self._namespaces.get(namespace)
                stored = space.parts if space else {}
                for count, key in enumerate(keys[start : start + step], start):
                    present = stored.get(key, ())
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
        found: list[StoredBlock] = []
        absent: list[tuple[int, int]] = []
        step = max(1, LOCK_SLICE // max(1, len(parts)))
        # (the loop runs once per block of a restore: its lookups are hoisted out of it)
        get, refresh = self._entries.get, self._entries.move_to_end
        tenant_order = None
        for start in range(0, len(keys), step):
            with self._lock:
                if self._tenant_of is not None:  # (a namespace belongs to one tenant)
                    tenant = self._tenants.get(self._tenant_of(namespace))
                    tenant_order = tenant.order.move_to_end if tenant else None
                for index, key in enumerate(keys[start : start + step], start):
                    for part in parts:
                        entry_key = (namespace, key, part)
                        entry = get(entry_key)
                        if entry is None:
                            absent.append((index, part))
                            continue
                        refresh(entry_key)
                        if tenant_order is not None:
                            tenant_order(entry_key)
                        found.append(StoredBlock(index, part, entry[0], entry[1]))
        with self._lock:
            self._hits += len(found)
            self._ram_rate.add(len(found))
        if self.disk is not None and found:
            self.disk.touch(namespace, [(keys[block.key_index], block.part) for block in found])
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
                size = entry_bytes(namespace, keys[index], len(block[0]))
                fits = self.max_bytes == UNLIMITED or size <= self.max_bytes
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
        removed: set[EntryKey] = set()
        for start in range(0, len(keys), LOCK_SLICE):
            batch = keys[start : start + LOCK_SLICE]
            with self._lock:
                removed |= self._remove_keys(namespace, batch)
                if self.disk:
                    removed |= self.disk.delete(namespace, batch)
        return len(removed)

    def clear(self, namespace: bytes) -> int:
        """Remove everything stored under `namespace`; returns how many entries went.

        The RAM tier's entries go a slice at a time, then the disk tier's all at once (its
        clear costs the same whatever it holds), so other clients wait for neither."""
        doomed: set[EntryKey] = set()
        while True:
            with self._lock:
                space = self._namespaces.get(namespace)
                if space is None:  # (RAM first: its evictions spill to the disk)
                    cleared = self.disk.clear(namespace) if self.disk else None
                    break
                doomed |= self._remove_keys(namespace, list(islice(space.parts, LOCK_SLICE)))
        if cleared is None:
            return len(doomed)
        return len(cleared) + sum((key, part) not in cleared for _, key, part in doomed)

    def usage(self, tenant: bytes) -> tuple[int, int, int]:
        """(entries, bytes_used, evictions) of a tenant's blocks in the RAM tier (with
        `tenant_of`), from counters kept as they change: the same cost however many namespaces
        any tenant holds."""
        with self._lock:
            held = self._tenants.get(tenant)
            evictions = self._tenant_evictions.get(tenant, 0)
            return (len(held.order), held.bytes_used, evictions) if held else (0, 0, evictions)

    def held(self) -> dict[EntryKey, bytes | memoryview]:
        """The RAM tier's entries now, (namespace, key, part) → payload, least recently used
        first (the disk tier's are not in it): a copy of the index, not of the payloads, for
        inspection. Reads nothing, so no entry is refreshed."""
        with self._lock:
            return {entry_key: payload for entry_key, (payload, _) in self._entries.items()}

    def stats(self) -> StoreStats:
        """A consistent snapshot of the RAM tier's counters, with the disk tier's (taken after
        the store lock is released: they cost the disk tier's lock, not the store's)."""
        disk = self.disk.stats() if self.disk else None
        with self._lock:
            return StoreStats(
                entries=len(self._entries),
                bytes_used=self._bytes_used,
                payload_bytes=self._payload_bytes,
                max_bytes=self.max_bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                rejected=self._rejected,
                ram_hits=self._hits - self._disk_hits,
                ram_reads_per_s=self._ram_rate.per_second(),
                disk_hits=self._disk_hits,
                disk_reads_per_s=self._disk_rate.per_second(),
                disk=disk,
            )

    def durability_mark(self) -> int:
        """A position for `wait_durable`: blocks stored after it count there."""
        return self.disk.mark() if self.disk else 0

    def wait_durable(self, since: int, timeout: float = DURABLE_WAIT_S) -> bool:
        """With a disk tier, wait until every block stored so far is written to its segment
        (where a crash of the vault process cannot lose it), and synced when fsync is "always";
        False on timeout or when writing a block stored after `since` (a `durability_mark`)
        failed. True at once without a disk tier."""
        if self.disk is None:
            return True
        return self.disk.wait_written(self.disk.mark(), timeout, since)

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
        namespace, key, part = entry_key
        size = entry_bytes(namespace, key, len(payload))
        self._entries[entry_key] = (payload, checksum)
        space = self._namespaces.setdefault(namespace, _Namespace())
        space.parts[key] = (*space.parts.get(key, ()), part)  # _remove took `part` out
        self._bytes_used += size
        self._payload_bytes += len(payload)
        if self._tenant_of is not None:
            tenant = self._tenants.setdefault(self._tenant_of(namespace), _TenantLRU())
            tenant.order[entry_key] = None
            tenant.bytes_used += size
        while self.max_bytes != UNLIMITED and self._entries and self._over_cap():
            victim = self._victim()
            if self.disk:
                self.disk.spill(*victim, *self._entries[victim])
            self._remove(victim)
            self._evictions += 1
            if self._tenant_of is not None:
                owner = self._tenant_of(victim[0])
                self._tenant_evictions[owner] = self._tenant_evictions.get(owner, 0) + 1

    def _over_cap(self) -> bool:
        """Whether the RAM tier's entries and the disk tier's index hold more than max_bytes:
        the index is RAM too, counted where the disk tier caps it (the vault caps it at a share
        of max_bytes; a disk tier without an index cap is one a caller sized itself)."""
        index = self.disk.index_bytes if self.disk and self.disk.max_blocks else 0
        return self._bytes_used + index > self.max_bytes

    def _victim(self) -> EntryKey:
        """The entry to evict next: the least recently used of all, or with tenants that of the
        tenant holding the most bytes, even when that is the entry just stored (one block larger
        than the others' shares goes itself, never the blocks of tenants within theirs). The
        caller holds the lock."""
        if self._tenant_of is None:
            return next(iter(self._entries))  # the entry just stored is within the cap alone
        return next(iter(max(self._tenants.values(), key=lambda tenant: tenant.bytes_used).order))

    def _remove_keys(self, namespace: bytes, keys: Sequence[bytes]) -> set[EntryKey]:
        """Drop every part of `keys` from RAM; the entries that went. The caller holds the lock."""
        space = self._namespaces.get(namespace)
        removed = {
            (namespace, key, part)
            for key in keys
            for part in (space.parts.get(key, ()) if space else ())
        }
        for entry_key in removed:
            self._remove(entry_key)
        return removed

    def _remove(self, entry_key: EntryKey) -> None:
        """Drop one entry if present; the caller holds the lock."""
        entry = self._entries.pop(entry_key, None)
        if entry is None:
            return
        namespace, key, part = entry_key
        size = entry_bytes(namespace, key, len(entry[0]))
        self._bytes_used -= size
        self._payload_bytes -= len(entry[0])
        if self._tenant_of is not None:
            name = self._tenant_of(namespace)
            tenant = self._tenants[name]
            del tenant.order[entry_key]
            tenant.bytes_used -= size
            if not tenant.order:
                del self._tenants[name]
        space = self._namespaces[namespace]
        parts = tuple(other for other in space.parts[key] if other != part)
        if parts:
            space.parts[key] = parts
        else:
            del space.parts[key]
        if not space.parts:
            del self._namespaces[namespace]
