"""A cold tier without a server: engines write and read blocks on a shared filesystem directly.

`kv_cold = "file:///mnt/kv?tenant=alice&max_bytes=2TB"` (addresses.parse_file_url). Each block
part is one file, ``ROOT/TENANT/NAMESPACE/KEY.PART`` (namespace and key in hex: the namespace
fingerprints the model, dtype, layout and codec), holding a 64-byte header (magic, version,
payload length, the payload's checksum.block_checksum) then the payload; with a data key the
payload is sealed by the tier before it gets here, exactly as for a vault or a Redis.

- **Atomic writes.** A put writes ``.KEY.PART.RANDOM.tmp`` in the same directory (0600,
  O_EXCL), closes it and renames it over the final name (os.replace): a reader opens final
  names only, so it sees a whole block or none. No fsync: the tier is a cache, and every read
  checks length and checksum, so a file a power cut leaves short or zeroed is a miss (removed
  and recomputed), never wrong data. On NFS close() sends the data to the server before the
  rename (close-to-open), so another client that sees the name sees the whole file.
- **Many engines on one directory.** Nothing is locked: a name is only ever replaced whole, two
  writers of one block write the same bytes, and an eviction or damage removal racing another
  engine's is an ENOENT, ignored. Temporary files a crashed writer left are removed after
  STALE_TMP_S.
- **A byte cap, evicting by age.** The writer (the put queue's thread) scans its tenant's
  directory (one listing and stat per file) when its own writes since the last scan pass half
  the room that scan left below the cap, or UNSCANNED_SHARE of the cap, or RESCAN_S after the
  last scan; a scan past the cap deletes the oldest files (by write time) until LOW_WATER of
  the cap is left. Other engines' writes count from the next scan, so with N engines on one
  directory it passes the cap by at most (N - 1) x UNSCANNED_SHARE of it. Default cap: half of
  the filesystem's free space plus what the tier holds (as a vault's disk tier).
- **Lookups ask little**: one directory listing per lookup; Promote opens the files by name.
- **Reads** go into pooled, huge-page aligned receive buffers with O_DIRECT (no page cache,
  whole 4 KiB pages) where the filesystem accepts it, else buffered; which one is said at open
  (`read_mode`). A missing, short, changed or misfiled file is a miss; a damaged one is removed.
- **Permissions.** Files 0600, directories 0700. The tenant's directory open to group or others
  is refused (ConfigError naming it), as is a root that group or others may read or write (it
  may be searchable, 0711, for tenants of other users).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tierkv.addresses import parse_file_url
from tierkv.backends.base import BackendStats, BackendUnavailable, StorageTierStats
from tierkv.checksum import block_checksum
from tierkv.config import ClientConfig, ConfigError
from tierkv.logs import get_logger
from tierkv.reliability import CircuitBreaker, PendingPut, PutPayload, PutQueue
from tierkv.transfer import RECEIVE_BUFFERS, Into
from tierkv.wire.secrets import make_private_dir, valid_tenant

log = get_logger(__name__)

MAGIC = b"TKVF"
VERSION = 1
_HEADER = struct.Struct("<4sB3xQQ")  # magic version - payload length, checksum
HEADER_BYTES = 64
"""The header's room in a file: the payload starts on a cache line."""
PAGE_BYTES = 4096
"""O_DIRECT reads whole pages into page-aligned memory."""
RESCAN_S = 10.0
LOW_WATER = 0.9
"""An eviction leaves this share of the cap used."""
UNSCANNED_SHARE = 1 / 8
"""An engine writes at most this share of the cap between two scans of the directory."""
DEFAULT_FREE_FRACTION = 0.5
STALE_TMP_S = 600.0
READ_THREADS = 4
TMP_SUFFIX = ".tmp"


def file_name(key: bytes, part: int) -> str:
    """The name of one block part's file in its namespace's directory."""
    return f"{key.hex()}.{part}"


def _pages(size: int) -> int:
    return -(-size // PAGE_BYTES) * PAGE_BYTES


class _Scan:
    """What a scan of the tenant's directory found: files (mtime, size, path) and their bytes."""

    def __init__(self, directory: Path) -> None:
        self.files: list[tuple[float, int, str]] = []
        now = time.time()
        for space in _entries(directory):
            if not space.is_dir(follow_symlinks=False):
                continue
            for entry in _entries(Path(space.path)):
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if entry.name.endswith(TMP_SUFFIX):
                    if now - info.st_mtime > STALE_TMP_S:
                        _remove(entry.path)
                    continue
                self.files.append((info.st_mtime, info.st_size, entry.path))
        self.bytes = sum(size for _, size, _ in self.files)


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as found:
            return list(found)
    except OSError:
        return []


def _remove(path: str) -> bool:
    """Unlink `path`; False when it was gone already (another engine removed it)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


class FileTier:
    """Blocks of one tenant under a shared directory; thread-safe, safe beside other engines."""

    def __init__(
        self,
        root: str | Path,
        tenant: str,
        max_bytes: int | None = None,
        *,
        address: str | None = None,
        promote_deadline_s: float = 30.0,
        max_pending_bytes: int = 256 * 1024 * 1024,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 5.0,
        direct: bool = True,
    ) -> None:
        if not valid_tenant(tenant):
            raise ConfigError(
                f"file tier tenant {tenant!r}: expected letters, digits, _.- (not . or ..)"
            )
        self.root = Path(root)
        self.directory = self.root / tenant
        self.address = address or f"file://{self.root}?tenant={tenant}"
        self.promote_deadline_s = promote_deadline_s
        _check_root(self.root)
        try:
            if self.directory.exists():
                _check_private(self.directory)
            make_private_dir(self.directory)
        except OSError as exc:
            raise ConfigError(f"file tier {self.directory}: cannot use it: {exc}") from None
        self.read_mode, why = _read_mode(self.directory) if direct else ("buffered", "not asked")
        log.info("file tier %s: reads %s%s", self.directory, self.read_mode, why)
        self._lock = threading.Lock()
        self._made: set[str] = set()
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tierkv-file-read")
        self._breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s, self._probe)
        self._queue = PutQueue(self.address, self._send, self._breaker, max_pending_bytes)
        self._arena: np.ndarray | None = None
        self._arena_at = 0
        self._configured_cap = max_bytes
        self.max_bytes = 0
        """The cap in force (known after the first scan, when it is the default)."""
        self._used = 0
        self._scan_past = 0
        """The next scan is due when the estimate of the bytes held passes this."""
        self._scanned_at = -RESCAN_S
        self.hits = self.misses = self.evictions = self.corrupt = self.failed_calls = 0
        self._scan_and_evict()

    @classmethod
    def from_url(cls, url: str, client_cfg: ClientConfig) -> FileTier:
        """The tier of a file:/// URL (addresses.parse_file_url), with the client's limits."""
        root, tenant, cap = parse_file_url(url)
        return cls(
            root,
            tenant,
            cap,
            address=url,
            promote_deadline_s=client_cfg.promote_deadline_ms / 1000,
            max_pending_bytes=client_cfg.max_pending_bytes,
            breaker_failures=client_cfg.breaker_failures,
            breaker_cooldown_s=client_cfg.breaker_cooldown_s,
        )

    # ---- the Backend protocol -------------------------------------------------------------

    def put(
        self,
        namespace: bytes,
        key: bytes,
        part: int,
        payload: PutPayload,
        release: Callable[[], None] | None = None,
    ) -> None:
        self._queue.put(namespace, key, part, payload, release)

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        if not keys or not self._breaker.allow():
            return 0
        try:
            present = set(os.listdir(self.directory / namespace.hex()))
        except FileNotFoundError:
            return 0
        except OSError:
            self._record_failure()
            return 0
        wanted = sorted(set(parts))
        for index, key in enumerate(keys):
            if any(file_name(key, part) not in present for part in wanted):
                return index
        return len(keys)

    def promote(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts: Sequence[int],
        into: Into | None = None,
    ) -> dict[tuple[int, int], memoryview]:
        """See Backend.promote (`into` is not used: reads land in pooled aligned buffers)."""
        if not keys or not parts or not self._breaker.allow():
            return {}
        space = self.directory / namespace.hex()
        deadline = time.monotonic() + self.promote_deadline_s
        wanted = [(index, part) for index in range(len(keys)) for part in sorted(set(parts))]

        def read(index: int, part: int) -> memoryview | None:
            if time.monotonic() > deadline:
                return None
            return self._read(namespace, keys[index], part, space)

        found = {}
        for address, payload in zip(
            wanted, self._readers.map(lambda pair: read(*pair), wanted), strict=True
        ):
            if payload is not None:
                found[address] = payload
        with self._lock:
            self.hits += len(found)
            self.misses += len(wanted) - len(found)
        return found

    def flush(self, timeout: float | None = None) -> bool:
        return self._queue.flush(timeout)

    def server_stats(self) -> list[BackendStats]:
        started = time.monotonic()
        if not self.directory.is_dir():
            raise BackendUnavailable(f"file tier {self.directory}: not a directory any more")
        scan = _Scan(self.directory)
        with self._lock:
            disk = StorageTierStats(
                entries=len(scan.files),
                bytes_used=scan.bytes,
                max_bytes=self.max_bytes,
                hits=self.hits,
                reads_per_s=0.0,
                evictions=self.evictions,
                corrupt=self.corrupt,
                queued_bytes=self._queue.pending_bytes,
                kept=0,
                live_bytes=scan.bytes,  # every file is a readable block
            )
            return [
                BackendStats(
                    address=self.address,
                    role=f"file ({self.read_mode})",
                    entries=len(scan.files),
                    bytes_used=scan.bytes,
                    max_bytes=self.max_bytes,
                    hits=self.hits,
                    misses=self.misses,
                    evictions=self.evictions,
                    rejected=0,
                    uptime_s=0.0,
                    version="",
                    rtt_s=time.monotonic() - started,
                    disk=disk,
                )
            ]

    def clear(self, namespace: bytes) -> int:
        removed = 0
        for entry in _entries(self.directory / namespace.hex()):
            if not entry.name.endswith(TMP_SUFFIX):  # another engine's write in progress
                removed += _remove(entry.path)
        return removed

    def counters(self) -> dict[str, int | str]:
        with self._lock:
            mine: dict[str, int | str] = {
                "read_mode": self.read_mode,
                "evictions": self.evictions,
                "checksum_failures": self.corrupt,
                "failed_calls": self.failed_calls,
            }
        return {**self._queue.counters(), **mine}

    def close(self) -> None:
        self._queue.close(self.promote_deadline_s)
        self._breaker.stop()
        self._readers.shutdown(wait=True)

    # ---- reads ------------------------------------------------------------------------------

    def _read(self, namespace: bytes, key: bytes, part: int, space: Path) -> memoryview | None:
        """The verified payload of one file, or None (absent, short, damaged: removed)."""
        path = space / file_name(key, part)
        flags = os.O_RDONLY | (os.O_DIRECT if self.read_mode == "O_DIRECT" else 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            size = info.st_size
            buf = self._room(_pages(size))
            got = os.preadv(fd, [buf], 0)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                self._record_failure()
            return None
        finally:
            os.close(fd)
        if got == size >= HEADER_BYTES:
            magic, version, length, checksum = _HEADER.unpack_from(buf)
            payload = buf[HEADER_BYTES:size]
            # the GIL is given back while hashing: the other read threads' reads go on meanwhile
            if (
                magic == MAGIC
                and version == VERSION
                and length == len(payload)
                and block_checksum(namespace, key, part, payload) == checksum
            ):
                return payload
        with self._lock:
            self.corrupt += 1
        log.warning("file tier: %s is damaged (%d bytes); removed, a miss", path, size)
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == info.st_ino:  # not replaced since it was read
                _remove(str(path))
        return None

    def _room(self, size: int) -> memoryview:
        """`size` page-aligned writable bytes nobody else uses: the next of the current pooled
        receive buffer (huge-page aligned), of a new one when they do not fit, or their own."""
        if size > RECEIVE_BUFFERS.buffer_bytes:
            raw = np.empty(size + PAGE_BYTES, dtype=np.uint8)
            start = -raw.ctypes.data % PAGE_BYTES
            return raw[start : start + size].data
        with self._lock:
            if self._arena is None or self._arena_at + size > len(self._arena):
                self._arena, self._arena_at = RECEIVE_BUFFERS.take(), 0
            start = self._arena_at
            self._arena_at += size
            return self._arena.data[start : start + size]

    # ---- writes and the cap --------------------------------------------------------------------

    def _send(self, batch: list[PendingPut]) -> int:
        """Write `batch` (each file whole or not at all), then keep the cap; raises on failure."""
        for put in batch:
            self._write(put)
        written = sum(put.size + HEADER_BYTES for put in batch)
        with self._lock:
            self._used += written
            due = self._used > self._scan_past or time.monotonic() - self._scanned_at > RESCAN_S
        if due:
            self._scan_and_evict()
        return 0

    def _write(self, put: PendingPut) -> None:
        space = self.directory / put.namespace.hex()
        if space.name not in self._made:
            make_private_dir(space)
            self._made.add(space.name)
        name = file_name(put.key, put.part)
        checksum = block_checksum(put.namespace, put.key, put.part, *put.pieces, hold_gil=True)
        header = _HEADER.pack(MAGIC, VERSION, put.size, checksum).ljust(HEADER_BYTES, b"\0")
        temporary = space / f".{name}.{os.urandom(6).hex()}{TMP_SUFFIX}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            pending = [memoryview(header), *(memoryview(piece).cast("B") for piece in put.pieces)]
            while pending:
                done = os.writev(fd, pending)
                while pending and done >= len(pending[0]):
                    done -= len(pending[0])
                    pending.pop(0)
                if pending:
                    pending[0] = pending[0][done:]
            os.close(fd)
            fd = -1
            os.replace(temporary, space / name)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            _remove(str(temporary))
            raise

    def _scan_and_evict(self) -> None:
        """Count what the tenant's directory holds, and remove the oldest files past the cap."""
        scan = _Scan(self.directory)
        cap = self._configured_cap
        if cap is None:
            cap = int((shutil.disk_usage(self.directory).free + scan.bytes) * DEFAULT_FREE_FRACTION)
        used, evicted = scan.bytes, 0
        if used > cap:
            for _, size, path in sorted(scan.files):
                if used <= cap * LOW_WATER:
                    break
                if _remove(path):
                    evicted += 1
                used -= size
        with self._lock:
            self.max_bytes = cap
            self._used = used
            self._scan_past = used + min(max(cap - used, 0) // 2, int(cap * UNSCANNED_SHARE))
            self._scanned_at = time.monotonic()
            self.evictions += evicted

    def _record_failure(self) -> None:
        with self._lock:
            self.failed_calls += 1
        self._breaker.record_failure()

    def _probe(self) -> bool:
        return os.access(self.directory, os.R_OK | os.W_OK | os.X_OK)


def _check_root(root: Path) -> None:
    """ConfigError when `root` is missing (it is a mount: never created here) or others may read
    or write it (searching it, 0711, is allowed: tenants of other users reach their own)."""
    try:
        mode = stat.S_IMODE(root.stat().st_mode)
    except OSError as exc:
        raise ConfigError(f"file tier {root}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(root.stat().st_mode):
        raise ConfigError(f"file tier {root}: not a directory")
    if mode & 0o066:
        raise ConfigError(
            f"file tier {root}: group or others may read or write it (mode {mode:04o}); "
            f"run chmod 700 {root} (or 711 for tenants of several users)"
        )


def _check_private(directory: Path) -> None:
    """ConfigError when the tenant's `directory` is open to group or others."""
    mode = stat.S_IMODE(directory.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"file tier {directory}: open to group or others (mode {mode:04o}); "
            f"run chmod 700 {directory}"
        )


def _read_mode(directory: Path) -> tuple[str, str]:
    """("O_DIRECT", "") when the filesystem of `directory` opens files with O_DIRECT, else
    ("buffered", why not)."""
    if not hasattr(os, "O_DIRECT"):
        return "buffered", " (O_DIRECT: not on this platform)"
    probe = directory / f".probe.{os.urandom(6).hex()}{TMP_SUFFIX}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        return "buffered", f" (O_DIRECT refused: {exc.strerror})"
    os.close(fd)
    _remove(str(probe))
    return "O_DIRECT", ""
