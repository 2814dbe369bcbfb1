"""The vault's disk tier: blocks in append-only segment files under `disk_dir`, found by an index.

No gRPC and no RAM LRU here (store.py owns those). Each record in a segment is a header (magic,
kind, namespace and key lengths, part, payload length, payload checksum; then namespace, key and
a MAC of all of that under the directory's record key) followed by the payload. The payload
checksum is `checksum.block_checksum`, seeded with the block's address, so a damaged or misfiled
payload is a miss when read, never served. Deletes and clears are records too (kinds DELETE,
CLEAR), so a restart does not bring back what was removed. The index is kept per namespace, so
a clear drops its namespace's index at once, live and when its record is replayed at start-up:
neither costs more with the blocks other namespaces hold, nor a restart with the clears made.

Writes are queued (`write`, `spill`) and appended by one background thread with `pwritev`; a
queued block is readable from memory until it lands. `mark` and `wait_written` tell a caller
when what it queued has been handed to the kernel (and synced, under fsync "always"): from then
on a crash of the process cannot lose it, only a crash of the machine can (fsync decides how
much). A write that fails part-way (a full disk) is cut off its segment again, so nothing of
it lies past where the next write starts. On start the index is rebuilt by reading headers only
(payloads are seeked past); an invalid header is skipped up to the next valid one, and a torn
tail (the last record cut short by a crash) is truncated and reported.

Payloads are tenants' bytes, so a payload may hold what looks like a whole record, for another
tenant's namespace or a CLEAR of it. Recovery must never take such bytes for a record: the
header MAC is keyed BLAKE2b under `record.key`, 32 random bytes made when the directory is first
used (mode 0600, never sent anywhere), so only the vault can write a header that verifies, and
the scan resynchronises after damage only at such headers, checking at most
MAX_RESYNC_CANDIDATES places per segment (a tail of nothing but record magic costs a bounded
time; what lies past that is left in place, unread). Without its record key the records cannot
be told from damage: a directory whose segments hold records but whose key is missing, of the
wrong length or opens none of them is refused (DiskKeyError, naming the file), never truncated;
`reset=True` (`tierkv vault --disk-reset`) removes every segment and the key to start empty. The
directory is made 0700 and every file in it 0600, whatever the umask (payloads are tenants'
bytes, unsealed where their engines do not seal). Records of the first format (magic
TKVR, unkeyed xxh3 header checksum) are still read where the chain of records from a segment's
start reaches them, never as a place to resynchronise at nor after one.

Past `max_bytes` the oldest segment is dropped, with a second chance (CLOCK over segments): the
blocks of it read since they were written (`read_many`, or `touch` for reads the RAM tier
served) are first copied forward into the newest segment, unmarked, and only the others go. So
a block read at least once per pass over the disk stays, and a block written once and never read
goes after one pass: least recently used first, to the granularity of one pass. Copying costs
one read and one write of the kept blocks; at most KEEP_FRACTION of a segment is kept per
segment dropped (the tier stays that far below `max_bytes`, so copies never push it over), the
rest of the marked blocks going like cold ones. Marks are not kept across restarts.

Tenants (`share_by`, a vault of several): the tier also counts each tenant's indexed blocks and
payload bytes as they change (rebuilt from what recovery indexed), and a dropped segment copies
forward, besides read blocks, the unread blocks of every tenant within its fair share: at most
room / n payload bytes and max_blocks / n blocks, n the tenants holding disk blocks. So a tenant
within its share never loses a block to another's flood, as in RAM (store.py): only the blocks
of tenants over their share go, or, when none is over, those of the tenant holding the most
bytes (so every drop frees something). The tier then keeps a whole segment free below its cap,
so a segment's kept blocks always fit; making room copies each block forward at most once (one
pass), and each pass of other tenants' writes over the disk costs one copy of the blocks kept.

Reads of many blocks sort by position and coalesce neighbours into one `preadv` straight into
the buffers that are returned. A lock file (`flock`) keeps a second vault off the same directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import shutil
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import xxhash

from tierkv.checksum import block_checksum
from tierkv.config import FSYNC_MODES
from tierkv.errors import TierKVError
from tierkv.logs import get_logger
from tierkv.sizes import MIB
from tierkv.wire.secrets import make_private_dir

log = get_logger(__name__)

EntryKey = tuple[bytes, bytes, int]
"""(namespace, block key, part)"""

FSYNC_INTERVAL_S = 1.0
SEGMENT_BYTES = 256 * MIB
"""Largest segment file (smaller when the cap is small: at most an eighth of it)."""
WRITE_BEHIND_BYTES = 256 * MIB
"""Queued-but-unwritten payload bytes past which `wait_for_room` makes writers wait."""
WRITE_BEHIND_WAIT_S = 5.0
"""Longest a writer waits for room: a stalled disk (a hung NFS server) slows Puts, never stops
them; the queue then grows past WRITE_BEHIND_BYTES until the disk catches up."""
MAX_READ_BYTES = 64 * MIB
"""Largest single coalesced read."""
IOV_MAX = 1024
FAILED_RANGES = 64
"""Failed batches remembered for `wait_written`; before the oldest, every wait counts as failed."""
LOCK_NAME = "lock"
SEGMENT_SUFFIX = ".seg"
KEEP_FRACTION = 0.5
"""Most bytes of read blocks copied forward when one segment is dropped, as a share of a segment;
also the share of a segment the tier keeps free below its cap for those copies (a whole segment
with `share_by`)."""
INDEX_BYTES_PER_BLOCK = 600
"""RAM the index takes per disk block (measured 568 B with 16-byte keys and namespaces, rounded
up): what `max_index_bytes` is divided by to cap the blocks a disk tier indexes."""
SEGMENTS_PER_INDEX_CAP = 8
"""A segment holds at most 1/8 of the indexed-block cap, so reaching that cap drops about an
eighth of the blocks, not all of them (one segment of tiny blocks could hold them all)."""

MAGIC = b"TKV2"
LEGACY_MAGIC = b"TKVR"
"""The first format: its header checksum is unkeyed, so it is never resynchronised at."""
RECORD_KEY_NAME = "record.key"
RECORD_KEY_BYTES = 32
KIND_BLOCK, KIND_DELETE, KIND_CLEAR = 0, 1, 2
_FIXED = struct.Struct("<4sBxHHxxIQQ")  # magic kind - ns_len key_len -- part length checksum
_HEADER_SUM = struct.Struct("<Q")
_SCAN_CHUNK = 4 * MIB
MAX_RESYNC_CANDIDATES = 65_536
"""Places (record magic) a segment's scan checks for a header after damage, at most: past them
the rest of the segment is left unread (in place), so recovery time is bounded whatever a
tenant's payloads hold."""
PRIVATE_FILE_MODE = 0o600


DEFAULT_FREE_FRACTION = 0.5
"""Share of the filesystem's free space (plus the tier's own files) a disk tier caps itself at."""


def default_max_bytes(directory: Path) -> int:
    """The disk cap when none is configured; the same on every restart of a steady tier."""
    held = sum(path.stat().st_size for path in directory.glob(f"*{SEGMENT_SUFFIX}"))
    return int((shutil.disk_usage(directory).free + held) * DEFAULT_FREE_FRACTION)


class DiskLockedError(TierKVError, RuntimeError):
    """Another vault holds the disk directory."""


class DiskKeyError(TierKVError, RuntimeError):
    """The directory's record key is missing, of the wrong length or opens none of its records:
    the vault refuses to start rather than take every record for damage."""


class Location(NamedTuple):
    """Where one block's record lies."""

    segment: int
    record: int  # offset of the record's header in the segment
    header_len: int
    length: int
    checksum: int


@dataclass(frozen=True)
class DiskStats:
    """Counters of a DiskTier. bytes_used counts segment files, dead records included."""

    entries: int
    bytes_used: int
    max_bytes: int
    live_bytes: int
    queued_bytes: int
    segments: int
    evictions: int  # blocks dropped with their segment by the cap
    kept: int  # blocks copied forward when their segment was dropped (read, or within a share)
    corrupt: int  # blocks whose payload failed its checksum when read (then dropped)


@dataclass(frozen=True)
class Recovery:
    """What start-up found in the directory."""

    blocks: int
    payload_bytes: int
    seconds: float
    damaged: list[str]  # one description per truncated tail or skipped damaged range


class _Op(NamedTuple):
    kind: int
    namespace: bytes
    key: bytes
    part: int
    payload: bytes | memoryview
    checksum: int


BlockKey = tuple[bytes, int]
"""(block key, part) within a namespace"""


@dataclass
class _Space:
    """One namespace's blocks: where each lies on disk, which were read since written, which
    are queued. A clear drops the whole object, so it costs the same however many blocks the
    namespace (or the tier) holds."""

    namespace: bytes = b""
    """The namespace, one bytes object that every index entry of the namespace shares (each
    record's header would otherwise bring its own copy)."""
    index: dict[BlockKey, Location] = field(default_factory=dict)
    parts: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    """Tuples, not sets: an empty set alone is 216 bytes, a tuple of one part 48."""
    read: set[BlockKey] = field(default_factory=set)  # kept on eviction
    live_bytes: int = 0
    queued: dict[BlockKey, _Op] = field(default_factory=dict)
    queued_bytes: int = 0


@dataclass(slots=True)
class _Held:
    """One tenant's indexed blocks and their payload bytes (kept as they change)."""

    blocks: int = 0
    payload_bytes: int = 0


@dataclass(frozen=True)
class Cleared:
    """What `DiskTier.clear` took away from one namespace: blocks on disk and blocks queued."""

    on_disk: Collection[BlockKey]
    queued: Collection[BlockKey]

    def __contains__(self, block: object) -> bool:
        return block in self.on_disk or block in self.queued

    def __len__(self) -> int:
        return len(self.on_disk) + sum(block not in self.on_disk for block in self.queued)


def _header_mac(record_key: bytes, body: bytes) -> bytes:
    return hashlib.blake2b(body, key=record_key, digest_size=_HEADER_SUM.size).digest()


def _header(op: _Op, record_key: bytes) -> bytes:
    fixed = _FIXED.pack(
        MAGIC, op.kind, len(op.namespace), len(op.key), op.part, len(op.payload), op.checksum
    )
    body = fixed + op.namespace + op.key
    return body + _header_mac(record_key, body)


def _read_header(
    fd: int, pos: int, record_key: bytes, legacy: bool = True
) -> tuple[_Op, int, int] | None:
    """(op without payload, header length, payload length) of a valid header at `pos`; with
    `legacy`, a header of the first (unkeyed) format is valid too."""
    fixed = os.pread(fd, _FIXED.size, pos)
    if len(fixed) < _FIXED.size:
        return None
    magic, kind, ns_len, key_len, part, length, checksum = _FIXED.unpack(fixed)
    if magic not in (MAGIC, LEGACY_MAGIC if legacy else MAGIC) or kind > KIND_CLEAR:
        return None
    rest = os.pread(fd, ns_len + key_len + _HEADER_SUM.size, pos + _FIXED.size)
    if len(rest) < ns_len + key_len + _HEADER_SUM.size:
        return None
    body = fixed + rest[: ns_len + key_len]
    found = rest[ns_len + key_len :]
    if magic == MAGIC:
        if not secrets.compare_digest(found, _header_mac(record_key, body)):
            return None
    elif _HEADER_SUM.unpack(found)[0] != xxhash.xxh3_64_intdigest(body):
        return None
    op = _Op(kind, rest[:ns_len], rest[ns_len : ns_len + key_len], part, b"", checksum)
    return op, len(body) + _HEADER_SUM.size, length


class DiskTier:
    """Blocks on disk: queue writes, read many at once, survive restarts. Thread-safe."""

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        fsync: str = "interval",
        *,
        segment_bytes: int | None = None,
        write_behind_bytes: int = WRITE_BEHIND_BYTES,
        max_index_bytes: int | None = None,
        reset: bool = False,
    ) -> None:
        """`max_index_bytes`: RAM the index may take (None: unbounded); past it the oldest
        segment goes, as past `max_bytes`, at start-up too."""
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_MODES)}, got {fsync!r}")
        if max_bytes <= 0:
            raise ValueError(f"disk max_bytes must be positive, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.segment_bytes = segment_bytes or max(MIB, min(SEGMENT_BYTES, max_bytes // 8))
        self._keep_bytes = int(self.segment_bytes * KEEP_FRACTION)
        self._room = max(1, max_bytes - self._keep_bytes)
        """Bytes of segments new records may fill; the rest is for blocks kept on eviction."""
        self.max_blocks = (
            max(SEGMENTS_PER_INDEX_CAP, max_index_bytes // INDEX_BYTES_PER_BLOCK)
            if max_index_bytes
            else None
        )
        """Blocks the index may hold (None: as many as fit in max_bytes)."""
        self._write_behind = write_behind_bytes
        make_private_dir(self.directory)
        self._lock_fd = self._take_lock()
        self.reset_segments = self._reset() if reset else 0
        """Segments `reset` removed."""
        self._record_key = _record_key(self.directory, self._segment_ids())
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._spaces: dict[bytes, _Space] = {}
        self._indexed = 0  # blocks in the spaces' indexes
        self._tenant_of: Callable[[bytes], bytes] | None = None
        self._held: dict[bytes, _Held] = {}
        """tenant → its indexed blocks and their payload bytes (with `share_by` only)."""
        self._segment_keys: dict[int, set[EntryKey]] = {}  # may name blocks since gone
        self._fds: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._queue: deque[_Op] = deque()
        self._queued_bytes = 0
        self._live_bytes = 0
        self._evictions = self._kept = self._corrupt = 0
        self._closing = False
        self._torn = False  # the active segment holds remains of a failed write past its size
        self._busy = False
        self._enqueued = self._taken = self._handled = 0  # ops queued / taken / written so far
        self._failed: deque[tuple[int, int]] = deque()  # (first, last] ops of failed batches
        self._failed_forgotten = 0  # ops up to this one may have failed unremembered
        self._retry: list[_Op] = []
        """Deletes and clears of failed batches, written first in the next batch: they took
        effect (and were answered) when queued, so a failed write must not undo them at the next
        restart."""
        started = time.monotonic()
        damaged = [problem for segment in self._segment_ids() for problem in self._scan(segment)]
        self._active = max(self._fds, default=0) + 1
        self._open_segment(self._active)
        while self._index_full(0):  # written under a larger index cap
            self._drop_segment(min(self._sizes))
        self.recovery = Recovery(
            self._indexed, self._live_bytes, time.monotonic() - started, damaged
        )
        self._last_sync = time.monotonic()
        self._writer = threading.Thread(target=self._write_loop, name="tierkv-disk", daemon=True)
        self._writer.start()

    # ---- the API store.py uses ---------------------------------------------------------------

    def write(
        self, namespace: bytes, key: bytes, part: int, payload: bytes | memoryview, checksum: int
    ) -> None:
        """Queue a block (replacing any older copy); readable at once, on disk soon."""
        self._enqueue(_Op(KIND_BLOCK, namespace, key, part, payload, checksum))

    def spill(
        self, namespace: bytes, key: bytes, part: int, payload: bytes | memoryview, checksum: int
    ) -> None:
        """Queue a block only if the disk has no copy of it (the RAM tier evicts it)."""
        with self._lock:
            space = self._spaces.get(namespace)
            if space is not None and ((key, part) in space.queued or (key, part) in space.index):
                return
        self.write(namespace, key, part, payload, checksum)

    def record_fits(self, namespace: bytes, key: bytes, length: int) -> bool:
        """Whether a block of `length` payload bytes at this address can ever be written (a
        larger one is refused by the store, never acknowledged and then left out)."""
        header = _FIXED.size + len(namespace) + len(key) + _HEADER_SUM.size
        return header + length <= self._room

    @property
    def room(self) -> int:
        """Bytes of segments new records may fill."""
        return self._room

    def share_by(self, tenant_of: Callable[[bytes], bytes]) -> None:
        """Keep a fair share of the disk per tenant (`tenant_of`: namespace → its tenant; a
        vault of several tenants): past the cap, a tenant's unread blocks go only while it holds
        more than its share, as in RAM. Counts what recovery indexed once; counters from then
        on. Call before anything is written."""
        with self._lock:
            self._tenant_of = tenant_of
            if self.max_bytes >= 2 * self.segment_bytes:  # whole segments of copies fit
                self._room = self.max_bytes - self.segment_bytes
            for namespace, space in self._spaces.items():
                self._hold(namespace, len(space.index), space.live_bytes)

    def held_by(self, tenant: bytes) -> tuple[int, int]:
        """(blocks, payload bytes) a tenant holds on disk (with `share_by`; queued blocks not
        counted until written)."""
        with self._lock:
            held = self._held.get(tenant)
            return (held.blocks, held.payload_bytes) if held else (0, 0)

    def wait_for_room(self, timeout: float | None = WRITE_BEHIND_WAIT_S) -> bool:
        """Wait while more than the write-behind bound is queued; False on timeout."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._queued_bytes <= self._write_behind or self._closing, timeout
            )

    def mark(self) -> int:
        """A position in the write queue: everything queued so far."""
        with self._lock:
            return self._enqueued

    def wait_written(self, mark: int, timeout: float | None = None, since: int = 0) -> bool:
        """Wait until everything queued before `mark` was handled: written to its segment (in
        the kernel's page cache, which outlives this process), and synced when fsync is
        "always". False on timeout, or when the write of anything queued between `since` (an
        earlier mark) and `mark` failed (logged)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._handled >= mark, timeout):
                return False
            return since >= self._failed_forgotten and not any(
                first < mark and last > since for first, last in self._failed
            )

    def has(self, namespace: bytes, key: bytes, parts: Sequence[int]) -> bool:
        """Whether every one of `parts` of the block is on disk or queued."""
        with self._lock:
            space = self._spaces.get(namespace)
            if space is None:
                return False
            on_disk = space.parts.get(key, ())
            return all(part in on_disk or (key, part) in space.queued for part in parts)

    def read_many(
        self, namespace: bytes, wanted: Sequence[tuple[bytes, int]]
    ) -> list[tuple[bytes | memoryview, int] | None]:
        """(payload, checksum) of each wanted (key, part), None where absent or damaged."""
        found: list[tuple[bytes | memoryview, int] | None] = [None] * len(wanted)
        located: list[tuple[Location, int]] = []
        with self._lock:
            space = self._spaces.get(namespace) or _Space()
            for position, block in enumerate(wanted):
                op = space.queued.get(block)
                if op is not None:
                    found[position] = (op.payload, op.checksum)
                elif (loc := space.index.get(block)) is not None:
                    located.append((loc, position))
            segments = {loc.segment for loc, _ in located}
            fds = {segment: os.dup(self._fds[segment]) for segment in segments}
        try:
            located.sort()
            for run in _runs(located):
                for (loc, position), payload in zip(run, _read_run(fds, run), strict=True):
                    key, part = wanted[position]
                    if payload is not None and (
                        block_checksum(namespace, key, part, payload) == loc.checksum
                    ):
                        found[position] = (payload, loc.checksum)
                    else:
                        self._forget_corrupt((namespace, key, part), loc)
        finally:
            for fd in fds.values():
                os.close(fd)
        self.touch(namespace, [wanted[position] for _, position in located])
        return found

    def touch(self, namespace: bytes, read: Sequence[tuple[bytes, int]]) -> None:
        """Mark blocks as read (the RAM tier served them), so eviction keeps their disk copy."""
        with self._lock:
            space = self._spaces.get(namespace)
            if space is not None:
                space.read.update(block for block in read if block in space.index)

    def delete(self, namespace: bytes, keys: Sequence[bytes]) -> set[EntryKey]:
        """Remove every part of `keys`; the (namespace, key, part) entries that went."""
        removed: set[EntryKey] = set()
        with self._changed:
            space = self._spaces.get(namespace)
            if space is not None:
                doomed = set(keys)
                for block in [block for block in space.queued if block[0] in doomed]:
                    self._unqueue(space, block)
                    removed.add((namespace, *block))
                for key in keys:
                    for part in list(space.parts.get(key, ())):
                        self._unindex((namespace, key, part))
                        removed.add((namespace, key, part))
                self._prune(namespace)
            for key in keys:
                self._enqueue_locked(_Op(KIND_DELETE, namespace, key, 0, b"", 0))
        return removed

    def clear(self, namespace: bytes) -> Cleared:
        """Remove everything under `namespace` at once (however much it or the tier holds);
        what went."""
        with self._changed:
            space = self._drop_space(namespace)
            self._enqueue_locked(_Op(KIND_CLEAR, namespace, b"", 0, b"", 0))
        return Cleared(space.index.keys(), space.queued.keys())

    def stats(self) -> DiskStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return DiskStats(
                entries=self._indexed
                + sum(
                    block not in space.index
                    for space in self._spaces.values()
                    for block in space.queued
                ),
                bytes_used=sum(self._sizes.values()),
                max_bytes=self.max_bytes,
                live_bytes=self._live_bytes,
                queued_bytes=self._queued_bytes,
                segments=len(self._sizes),
                evictions=self._evictions,
                kept=self._kept,
                corrupt=self._corrupt,
            )

    def close(self, timeout: float | None = None) -> int:
        """Write what is queued (for at most `timeout` s), sync, release the directory.

        Returns how many queued blocks did not make it to disk (0 unless the timeout hit).
        """
        with self._changed:
            self._changed.wait_for(
                lambda: not self._queue and not self._busy and not self._retry, timeout
            )
            self._closing = True
            left = sum(len(space.queued) for space in self._spaces.values())
            self._changed.notify_all()
        self._writer.join()
        with self._lock:
            if self.fsync != "never":
                os.fsync(self._fds[self._active])
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        os.close(self._lock_fd)
        return left

    # ---- start-up ----------------------------------------------------------------------------

    def _take_lock(self) -> int:
        path = self.directory / LOCK_NAME
        fd = _open_private(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DiskLockedError(
                f"disk_dir {self.directory} is in use by another vault (pid {holder}); "
                "give each vault its own disk_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _segment_ids(self) -> list[int]:
        ids = []
        for path in self.directory.glob(f"*{SEGMENT_SUFFIX}"):
            if path.stem.isdigit():
                ids.append(int(path.stem))
        return sorted(ids)

    def _reset(self) -> int:
        """Remove every segment and the record key (the lock is held); how many segments."""
        segments = self._segment_ids()
        for segment in segments:
            self._segment_path(segment).unlink()
        (self.directory / RECORD_KEY_NAME).unlink(missing_ok=True)
        _sync_dir(self.directory)
        return len(segments)

    def _segment_path(self, segment: int) -> Path:
        return self.directory / f"{segment:010d}{SEGMENT_SUFFIX}"

    def _open_segment(self, segment: int) -> int:
        fd = _open_private(self._segment_path(segment), os.O_RDWR | os.O_CREAT)
        self._fds[segment] = fd
        self._sizes[segment] = os.fstat(fd).st_size
        self._segment_keys.setdefault(segment, set())
        return fd

    def _scan(self, segment: int) -> list[str]:
        """Index one segment's records (headers only); cut a torn tail; describe damage."""
        fd = self._open_segment(segment)
        size = self._sizes[segment]
        name = self._segment_path(segment).name
        damaged = []
        pos = 0
        legacy = True  # records of the first format only on the chain from the segment's start
        budget = [MAX_RESYNC_CANDIDATES]  # places left to check for a header after damage
        while pos < size:
            parsed = _read_header(fd, pos, self._record_key, legacy)
            if parsed is not None and pos + parsed[1] + parsed[2] <= size:
                op, header_len, length = parsed
                self._replay(op, Location(segment, pos, header_len, length, op.checksum))
                pos += header_len + length
                continue
            resume = _next_header(fd, pos + 1, size, self._record_key, budget)
            legacy = False
            if resume is None and not budget[0]:
                damaged.append(
                    f"{name}: {size - pos} bytes at {pos} left unread (more than "
                    f"{MAX_RESYNC_CANDIDATES} places to look for a record in them)"
                )
                break
            if resume is None:
                os.ftruncate(fd, pos)
                damaged.append(f"{name}: torn tail of {size - pos} bytes at {pos} truncated")
                self._sizes[segment] = size = pos
            else:
                damaged.append(f"{name}: {resume - pos} damaged bytes at {pos} skipped")
                pos = resume
        if size == 0:
            os.close(self._fds.pop(segment))
            del self._sizes[segment], self._segment_keys[segment]
            self._segment_path(segment).unlink()
        return damaged

    def _replay(self, op: _Op, loc: Location) -> None:
        """Replay one record found at `loc` on start-up (a CLEAR costs the same whatever the
        namespace holds, so a restart costs the same however many clears came before)."""
        if op.kind == KIND_DELETE:
            space = self._spaces.get(op.namespace)
            for part in list(space.parts.get(op.key, ())) if space else ():
                self._unindex((op.namespace, op.key, part))
            self._prune(op.namespace)
        elif op.kind == KIND_CLEAR:
            self._drop_space(op.namespace)
        else:
            self._reindex(_key(op), loc)

    # ---- index bookkeeping (caller holds the lock) ------------------------------------------

    def _location(self, entry_key: EntryKey) -> Location | None:
        space = self._spaces.get(entry_key[0])
        return space.index.get(entry_key[1:]) if space is not None else None

    def _queued_op(self, op: _Op) -> _Op | None:
        """The op queued for the block `op` writes (it, a newer one, or none)."""
        space = self._spaces.get(op.namespace)
        return space.queued.get((op.key, op.part)) if space is not None else None

    def _reindex(self, entry_key: EntryKey, loc: Location) -> None:
        """Index a new copy of the block at `loc` (unread so far)."""
        namespace, key, part = entry_key
        space = self._spaces.get(namespace)
        if space is None:
            space = self._spaces[namespace] = _Space(namespace)
        old = space.index.get((key, part))
        if old is None:
            space.parts[key] = (*space.parts.get(key, ()), part)
            self._indexed += 1
        else:
            space.read.discard((key, part))
            space.live_bytes -= old.length
            self._live_bytes -= old.length
        space.index[key, part] = loc
        space.live_bytes += loc.length
        self._live_bytes += loc.length
        self._hold(namespace, int(old is None), loc.length - (old.length if old else 0))
        self._segment_keys[loc.segment].add((space.namespace, key, part))

    def _unindex(self, entry_key: EntryKey) -> None:
        """Forget where a block lies (the caller prunes its space once done with it)."""
        namespace, key, part = entry_key
        space = self._spaces.get(namespace)
        loc = space.index.pop((key, part), None) if space is not None else None
        if space is None or loc is None:
            return
        self._indexed -= 1
        space.read.discard((key, part))
        space.live_bytes -= loc.length
        self._live_bytes -= loc.length
        self._hold(namespace, -1, -loc.length)
        parts = tuple(other for other in space.parts[key] if other != part)
        if parts:
            space.parts[key] = parts
        else:
            del space.parts[key]

    def _hold(self, namespace: bytes, blocks: int, length: int) -> None:
        """Count `blocks` more indexed blocks of `length` more payload bytes for the
        namespace's tenant (with `share_by`); a tenant that holds none is forgotten."""
        if self._tenant_of is None or not (blocks or length):
            return
        tenant = self._tenant_of(namespace)
        held = self._held.get(tenant)
        if held is None:
            held = self._held[tenant] = _Held()
        held.blocks += blocks
        held.payload_bytes += length
        if held.blocks <= 0:
            del self._held[tenant]

    def _within_share(self) -> set[bytes]:
        """Tenants whose unread blocks a dropped segment copies forward: those holding at most
        their fair share (room / tenants holding disk blocks, and as much of max_blocks); when
        all do, all but the one holding the most bytes, so a drop always frees something."""
        if not self._held:
            return set()
        share = self._room // len(self._held)
        blocks = self.max_blocks // len(self._held) if self.max_blocks else None
        within = {
            tenant
            for tenant, held in self._held.items()
            if held.payload_bytes <= share and (blocks is None or held.blocks <= blocks)
        }
        if len(within) == len(self._held):
            within.discard(max(self._held, key=lambda tenant: self._held[tenant].payload_bytes))
        return within

    def _unqueue(self, space: _Space, block: BlockKey) -> None:
        size = len(space.queued.pop(block).payload)
        space.queued_bytes -= size
        self._queued_bytes -= size
        self._changed.notify_all()

    def _prune(self, namespace: bytes) -> None:
        """Drop the namespace's space once it holds nothing."""
        space = self._spaces.get(namespace)
        if space is not None and not space.index and not space.queued:
            del self._spaces[namespace]

    def _drop_space(self, namespace: bytes) -> _Space:
        """Take a namespace's blocks off the tier (on disk and queued) at once."""
        space = self._spaces.pop(namespace, None) or _Space()
        self._indexed -= len(space.index)
        self._live_bytes -= space.live_bytes
        self._hold(namespace, -len(space.index), -space.live_bytes)
        if space.queued:
            self._queued_bytes -= space.queued_bytes
            self._changed.notify_all()
        return space

    def _forget_corrupt(self, entry_key: EntryKey, loc: Location) -> None:
        with self._lock:
            if self._location(entry_key) == loc:
                self._unindex(entry_key)
                self._prune(entry_key[0])
                self._corrupt += 1

    # ---- the writer thread -------------------------------------------------------------------

    def _enqueue(self, op: _Op) -> None:
        with self._changed:
            self._enqueue_locked(op)

    def _enqueue_locked(self, op: _Op) -> None:
        if self._closing:
            return
        if op.kind == KIND_BLOCK:
            space = self._spaces.get(op.namespace)
            if space is None:
                space = self._spaces[op.namespace] = _Space(op.namespace)
            old = space.queued.pop((op.key, op.part), None)
            size = len(op.payload) - (len(old.payload) if old else 0)
            space.queued[op.key, op.part] = op
            space.queued_bytes += size
            self._queued_bytes += size
        self._queue.append(op)
        self._enqueued += 1
        self._changed.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closing, FSYNC_INTERVAL_S)
                if self._closing:
                    return
                batch, self._retry = self._retry, []  # (retried at most once per interval)
                size = 0
                first = self._taken
                while self._queue and size < MAX_READ_BYTES:
                    op = self._queue.popleft()
                    self._taken += 1
                    if op.kind != KIND_BLOCK or self._queued_op(op) is op:
                        batch.append(op)
                        size += len(op.payload)
                self._busy = bool(batch)
                taken = self._taken
                if not batch:
                    self._handled = taken
                    self._changed.notify_all()
            try:  # the writer must outlive any failure, or Puts would stall
                if batch:
                    self._append(batch)
                    if self.fsync == "always":
                        self._sync()
            except Exception:
                log.exception("tierkv vault: disk tier cannot write to %s", self.directory)
                with self._lock:
                    self._retry = [op for op in batch if op.kind != KIND_BLOCK]
                    if len(self._failed) == FAILED_RANGES:
                        self._failed_forgotten = self._failed.popleft()[1]
                    self._failed.append((first, taken))
            if batch:
                self._forget(batch, taken)  # Puts waiting for this batch are answered now
            try:  # after the batch is answered: no Put waits for this sync
                if (
                    self.fsync == "interval"
                    and time.monotonic() - self._last_sync >= FSYNC_INTERVAL_S
                ):
                    self._sync()
            except OSError:
                log.exception("tierkv vault: disk tier cannot sync %s", self.directory)

    def _append(self, batch: list[_Op]) -> None:
        """Write `batch` to the active segment(s), then index the blocks still current. A batch
        that fails leaves nothing: its Puts are refused, and records left on disk but never
        indexed would come back at the next restart."""
        if self._torn:
            self._roll()
            self._torn = False
        written: list[tuple[_Op, Location]] = []
        landed: list[tuple[int, int]] = []  # (segment, start) of the pieces written so far
        iov: list[bytes | memoryview] = []
        start = offset = self._sizes[self._active]
        in_active = 0  # records of this batch in the active segment, not yet indexed
        try:
            for op in batch:
                header = _header(op, self._record_key)
                record_len = len(header) + len(op.payload)
                if record_len > self._room:  # the store refuses such blocks (record_fits)
                    log.warning(
                        "tierkv vault: a record of %d bytes never fits the disk tier (%d bytes)",
                        record_len,
                        self._room,
                    )
                    continue
                if (
                    self._needs_room(record_len, offset - start, len(written), in_active)
                    or len(iov) + 2 > IOV_MAX
                ):
                    self._write_iov(iov, start)
                    if iov:
                        landed.append((self._active, start))
                    iov = []
                    active = self._active
                    self._make_room(record_len, len(written), in_active)
                    in_active = in_active if self._active == active else 0
                    start = offset = self._sizes[self._active]
                iov += [header, op.payload]
                loc = Location(self._active, offset, len(header), len(op.payload), op.checksum)
                written.append((op, loc))
                in_active += 1
                offset += record_len
            self._write_iov(iov, start)
        except BaseException:
            for segment, piece_start in landed:
                self._cut(segment, piece_start)
            raise
        with self._changed:  # (deletes and clears took effect when they were queued)
            for op, loc in written:
                if (
                    op.kind == KIND_BLOCK
                    and self._queued_op(op) is op
                    and loc.segment in self._sizes
                ):
                    self._reindex(_key(op), loc)  # not replaced, deleted or dropped meanwhile

    def _forget(self, batch: list[_Op], taken: int) -> None:
        """Take the blocks of a handled batch off the queue (whether or not they landed) and
        count the first `taken` queued ops as handled."""
        with self._changed:
            for op in batch:
                if op.kind == KIND_BLOCK and self._queued_op(op) is op:
                    self._unqueue(self._spaces[op.namespace], (op.key, op.part))
                    self._prune(op.namespace)
            self._busy = False
            self._handled = taken
            self._changed.notify_all()

    def _needs_room(self, record_len: int, unwritten: int, pending: int, in_active: int) -> bool:
        """Whether a record must start a new segment or push out old ones first (`pending`
        records of the batch written so far, `in_active` of them in the active segment, are not
        indexed yet)."""
        size = self._sizes[self._active] + unwritten
        total = sum(self._sizes.values()) + unwritten
        return (
            (size > 0 and self._segment_full(size + record_len, in_active))
            or total + record_len > self._room
            or self._index_full(pending + 1)
        )

    def _segment_full(self, size: int, in_active: int) -> bool:
        """Whether the active segment is full at `size` bytes and `in_active` more records."""
        if size > self.segment_bytes:
            return True
        records = len(self._segment_keys[self._active]) + in_active
        return self.max_blocks is not None and records * SEGMENTS_PER_INDEX_CAP >= self.max_blocks

    def _write_iov(self, iov: list[bytes | memoryview], start: int) -> None:
        if not iov:
            return
        fd = self._fds[self._active]
        total = sum(map(len, iov))
        try:
            done = os.pwritev(fd, iov, start)
            while done < total:  # a short write: finish the rest from where it stopped
                rest = b"".join(bytes(part) for part in iov)[done:]
                done += os.pwrite(fd, rest, start + done)
        except BaseException:
            # What landed of a failed write goes: the next write starts at `start`, and the
            # complete records of this batch left past its end would be replayed after it.
            self._cut(self._active, start)
            raise
        with self._lock:
            self._sizes[self._active] = start + total

    def _cut(self, segment: int, size: int) -> None:
        """Cut `segment` back to `size` bytes after a failed write (if it is still there)."""
        fd = self._fds.get(segment)
        if fd is None:
            return
        try:
            os.ftruncate(fd, size)
        except OSError:
            log.exception("tierkv vault: disk tier cannot cut segment %d back", segment)
            if segment == self._active:
                self._torn = True  # then the next write starts a new segment
            return
        with self._lock:
            self._sizes[segment] = size

    def _make_room(self, record_len: int, pending: int, in_active: int) -> None:
        """Start a new segment when the active one is full; drop the oldest past the caps,
        copying forward its blocks read since they were written and those of tenants within
        their share (`pending`, `in_active`: as for _needs_room)."""
        size = self._sizes[self._active]
        if size > 0 and self._segment_full(size + record_len, in_active):
            self._roll()
        budget = self._keep_bytes  # read blocks, for all segments dropped now
        first_copy = self._active  # segments from here on may hold this call's copies
        while sum(self._sizes.values()) + record_len > self._room or self._index_full(pending + 1):
            oldest = min(self._sizes)
            if oldest == self._active:
                self._roll()
            # one pass at most: a block copied forward now is not copied again (the loop ends)
            budget -= self._keep_blocks(oldest, budget, share=oldest < first_copy)
            self._drop_segment(oldest)

    @property
    def index_bytes(self) -> int:
        """RAM the index takes once what is queued is written (INDEX_BYTES_PER_BLOCK per block,
        an estimate; every queued op counted as a block, within max_blocks)."""
        blocks = self._indexed + self._enqueued - self._handled
        return min(blocks, self.max_blocks or blocks) * INDEX_BYTES_PER_BLOCK

    def _index_full(self, adding: int) -> bool:
        """Whether `adding` more blocks would take the index past max_blocks (while an older
        segment than the active one is left to drop)."""
        return (
            self.max_blocks is not None
            and self._indexed + adding > self.max_blocks
            and min(self._sizes) != self._active
        )

    def _keep_blocks(self, segment: int, budget: int, share: bool) -> int:
        """Append to the active segment the blocks of `segment` that stay: with `share`, the
        unread ones of tenants within their fair share (`share_by`); and the read ones, at most
        `budget` bytes of records; all as long as the cap allows (share first). The copies are
        unread again. Returns the bytes of read blocks' records chosen."""
        room = self.max_bytes - sum(self._sizes.values())
        chosen = spent = 0
        with self._lock:
            within = self._within_share() if share and self._tenant_of is not None else set()
            shared: list[tuple[Location, EntryKey]] = []
            read: list[tuple[Location, EntryKey]] = []
            for entry_key in self._segment_keys[segment]:
                space = self._spaces.get(entry_key[0])
                loc = space.index.get(entry_key[1:]) if space is not None else None
                # A block queued again has a newer copy on its way: the old one must not follow.
                if space is None or loc is None or loc.segment != segment:
                    continue
                if entry_key[1:] in space.queued:
                    continue
                if within and self._tenant_of and self._tenant_of(entry_key[0]) in within:
                    shared.append((loc, entry_key))
                elif entry_key[1:] in space.read:
                    read.append((loc, entry_key))
            kept: list[tuple[Location, int]] = []
            entry_keys: list[EntryKey] = []
            for candidates, paid in ((shared, False), (read, True)):
                for loc, entry_key in sorted(candidates):
                    size = loc.header_len + loc.length
                    if spent + size > room or (paid and chosen + size > budget):
                        continue
                    spent += size
                    chosen += size if paid else 0
                    kept.append((loc, len(entry_keys)))
                    entry_keys.append(entry_key)
        kept.sort()
        for run in _runs(kept):
            ops = []
            for (loc, position), payload in zip(run, _read_run(self._fds, run), strict=True):
                namespace, key, part = entry_keys[position]
                if payload is not None and block_checksum(namespace, key, part, payload) == (
                    loc.checksum
                ):
                    ops.append((_Op(KIND_BLOCK, namespace, key, part, payload, loc.checksum), loc))
            self._copy_forward(ops)
        return chosen

    def _copy_forward(self, ops: list[tuple[_Op, Location]]) -> None:
        """Write `ops` (blocks now at the given locations) to the active segment, reindexed
        where the block is still where it was (not deleted or replaced meanwhile)."""
        iov: list[bytes | memoryview] = []
        moved: list[tuple[_Op, Location, Location]] = []
        start = offset = self._sizes[self._active]
        for op, old in ops:
            header = _header(op, self._record_key)
            if offset > 0 and offset + len(header) + len(op.payload) > self.segment_bytes:
                self._write_iov(iov, start)
                iov = []
                self._roll()
                start = offset = self._sizes[self._active]
            iov += [header, op.payload]
            moved.append((op, old, Location(self._active, offset, len(header), *old[3:])))
            offset += len(header) + len(op.payload)
        self._write_iov(iov, start)
        with self._lock:
            for op, old, new in moved:
                if self._location(_key(op)) == old:
                    self._reindex(_key(op), new)
                    self._kept += 1

    def _roll(self) -> None:
        self._sync()
        with self._lock:
            self._active += 1
            self._open_segment(self._active)
        if self.fsync != "never":
            _sync_dir(self.directory)

    def _drop_segment(self, segment: int) -> None:
        with self._lock:
            for entry_key in self._segment_keys.pop(segment):
                loc = self._location(entry_key)
                if loc is not None and loc.segment == segment:
                    self._unindex(entry_key)
                    self._prune(entry_key[0])
                    self._evictions += 1
            os.close(self._fds.pop(segment))
            del self._sizes[segment]
        self._segment_path(segment).unlink()

    def _sync(self) -> None:
        if self.fsync != "never":
            os.fsync(self._fds[self._active])
        self._last_sync = time.monotonic()


def _key(op: _Op) -> EntryKey:
    return (op.namespace, op.key, op.part)


def _runs(located: list[tuple[Location, int]]) -> list[list[tuple[Location, int]]]:
    """Sorted locations grouped into runs of adjacent records of one segment."""
    runs: list[list[tuple[Location, int]]] = []
    size = 0
    for item in located:
        loc = item[0]
        if runs:
            last = runs[-1][-1][0]
            adjacent = (
                loc.segment == last.segment
                and loc.record == last.record + last.header_len + last.length
            )
            if adjacent and len(runs[-1]) < IOV_MAX // 2 and size + loc.length <= MAX_READ_BYTES:
                runs[-1].append(item)
                size += loc.length
                continue
        runs.append([item])
        size = loc.length
    return runs


def _read_run(fds: dict[int, int], run: list[tuple[Location, int]]) -> list[memoryview | None]:
    """The payloads of adjacent records, read with one preadv; None for any cut short."""
    payloads = [bytearray(loc.length) for loc, _ in run]
    scratch = memoryview(bytearray(max(loc.header_len for loc, _ in run)))
    iov: list[memoryview | bytearray] = []
    for (loc, _), payload in zip(run, payloads, strict=True):
        iov += [scratch[: loc.header_len], payload]
    first = run[0][0]
    try:
        got = os.preadv(fds[first.segment], iov, first.record)
    except OSError:
        got = 0
    result: list[memoryview | None] = []
    end = first.record
    for (loc, _), payload in zip(run, payloads, strict=True):
        end += loc.header_len + loc.length
        complete = got >= end - first.record
        result.append(memoryview(payload).toreadonly() if complete else None)
    return result


def _open_private(path: Path, flags: int) -> int:
    """os.open of a file of the directory, made 0600 whatever the umask or its mode before."""
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    if stat.S_IMODE(os.fstat(fd).st_mode) != PRIVATE_FILE_MODE:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    return fd


def _record_key(directory: Path, segments: Sequence[int]) -> bytes:
    """The directory's record key, made on first use (only this vault can write it) while no
    segment holds records; DiskKeyError when segments hold records and the key is missing, of
    the wrong length, or opens none of them."""
    path = directory / RECORD_KEY_NAME
    paths = [directory / f"{segment:010d}{SEGMENT_SUFFIX}" for segment in segments]
    written = [segment for segment in paths if segment.stat().st_size]
    what_to_do = (
        "restore it from a backup, or start the vault with --disk-reset to start empty "
        f"(removes the {len(written)} segments on disk)"
    )
    try:
        fd = _open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        if written:
            raise DiskKeyError(
                f"{path} is missing, and {len(written)} segments hold records only it opens: "
                + what_to_do
            ) from None
        return _new_record_key(directory, path)
    try:
        key = os.read(fd, RECORD_KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != RECORD_KEY_BYTES:
        raise DiskKeyError(
            f"{path} holds {len(key)} bytes, not a record key of {RECORD_KEY_BYTES}: " + what_to_do
        )
    verdicts = {_opens_first_record(segment, key) for segment in written}
    if False in verdicts and True not in verdicts:
        raise DiskKeyError(
            f"{path} opens none of the {len(written)} segments' records (not the key that wrote "
            "them): " + what_to_do
        )
    return key


def _opens_first_record(segment: Path, record_key: bytes) -> bool | None:
    """Whether the first record of a written segment verifies under `record_key` (one of the
    first format, unkeyed, counts as opened); None when its header is not whole (a crash cut
    the segment's first write), which tells nothing of the key."""
    fd = os.open(segment, os.O_RDONLY)
    try:
        if os.pread(fd, len(LEGACY_MAGIC), 0) == LEGACY_MAGIC:
            return True
        if _read_header(fd, 0, record_key, legacy=False) is not None:
            return True
        fixed = os.pread(fd, _FIXED.size, 0)
        if len(fixed) < _FIXED.size:
            return None
        ns_len, key_len = _FIXED.unpack(fixed)[2:4]
        whole = _FIXED.size + ns_len + key_len + _HEADER_SUM.size
        return None if os.fstat(fd).st_size < whole else False
    finally:
        os.close(fd)


def _new_record_key(directory: Path, path: Path) -> bytes:
    key = secrets.token_bytes(RECORD_KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    _sync_dir(directory)
    return key


def _next_header(fd: int, pos: int, size: int, record_key: bytes, budget: list[int]) -> int | None:
    """Offset of the next record header at or after `pos` that verifies under `record_key`
    (never one of the first format, whose checksum anyone can compute), else None; checks at
    most budget[0] places, taking them off it (None when it runs out)."""
    while pos < size:
        chunk = os.pread(fd, _SCAN_CHUNK + _FIXED.size, pos)
        at = chunk.find(MAGIC)
        while at != -1:
            if budget[0] <= 0:
                return None
            budget[0] -= 1
            parsed = _read_header(fd, pos + at, record_key, legacy=False)
            if parsed is not None and pos + at + parsed[1] + parsed[2] <= size:
                return pos + at
            at = chunk.find(MAGIC, at + 1)
        pos += _SCAN_CHUNK
    return None


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
