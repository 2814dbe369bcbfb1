"""A Backend in this process's memory: the protocol's smallest implementation.

It stores each payload whole at once (a put is acknowledged before it returns), never fails and
ignores `into`; a Promote returns copies, so the caller may keep them. It lets what stands on the
protocol (ColdTier's runs, deadline and partial failures) be exercised without sockets, and shows
what a new backend has to provide. Nothing is shared between instances or kept after `close`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from tierkv.backends.base import BackendStats
from tierkv.reliability import PutPayload
from tierkv.transfer import Into


class MemoryBackend:
    """Payloads by (namespace, key, part) in a dict; `address` only names it in messages."""

    def __init__(self, address: str = "memory") -> None:
        self.address = address
        self._blocks: dict[tuple[bytes, bytes, int], bytes] = {}
        self._lock = threading.Lock()
        self._stored_puts = 0
        self._hits = 0
        self._misses = 0

    def put(
        self,
        namespace: bytes,
        key: bytes,
        part: int,
        payload: PutPayload,
        release: Callable[[], None] | None = None,
    ) -> None:
        pieces = payload if isinstance(payload, tuple) else (payload,)
        stored = b"".join(pieces)
        with self._lock:
            self._blocks[(namespace, key, part)] = stored
            self._stored_puts += 1
        if release is not None:
            release()

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        with self._lock:
            for at, key in enumerate(keys):
                if any((namespace, key, part) not in self._blocks for part in parts):
                    return at
        return len(keys)

    def promote(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts: Sequence[int],
        into: Into | None = None,
    ) -> dict[tuple[int, int], memoryview]:
        found: dict[tuple[int, int], memoryview] = {}
        with self._lock:
            for index, key in enumerate(keys):
                for part in parts:
                    payload = self._blocks.get((namespace, key, part))
                    if payload is None:
                        self._misses += 1
                        continue
                    self._hits += 1
                    found[(index, part)] = memoryview(bytearray(payload))
        return found

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def server_stats(self) -> list[BackendStats]:
        with self._lock:
            return [
                BackendStats(
                    address=self.address,
                    role="",
                    entries=len(self._blocks),
                    bytes_used=sum(map(len, self._blocks.values())),
                    max_bytes=0,
                    hits=self._hits,
                    misses=self._misses,
                    evictions=0,
                    rejected=0,
                    uptime_s=0.0,
                    version="",
                    rtt_s=0.0,
                )
            ]

    def clear(self, namespace: bytes) -> int:
        with self._lock:
            gone = [address for address in self._blocks if address[0] == namespace]
            for address in gone:
                del self._blocks[address]
        return len(gone)

    def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Remove every part of `keys` (a block lost, for a test); the entries removed."""
        wanted = set(keys)
        with self._lock:
            gone = [a for a in self._blocks if a[0] == namespace and a[1] in wanted]
            for address in gone:
                del self._blocks[address]
        return len(gone)

    def counters(self) -> dict[str, int | str]:
        with self._lock:
            return {"stored_puts": self._stored_puts}

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
