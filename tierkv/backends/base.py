"""The Backend protocol every cold store implements, and the reliability parts they share.

A backend stores verified payloads under (namespace, key, part) and gives them back:
`put` never blocks, `lookup` and `promote` never raise and never wait past the client deadline
(any failure is a miss), `flush` waits for queued puts, `stats` reports each server behind it.

Shared by the backends instead of written once each: `CircuitBreaker` (the vault client's; after
`breaker_failures` consecutive failures calls answer "miss" at once until a probe succeeds) and
`PutQueue` (a byte-bounded queue that drops the oldest puts when full and sends batches from one
background thread through the backend's `send`, counting every put that is lost).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from tierkv.vault.client import CircuitBreaker, VaultStats, VaultUnavailable

__all__ = [
    "Backend",
    "CircuitBreaker",
    "PendingPut",
    "PutQueue",
    "VaultStats",
    "VaultUnavailable",
]

log = logging.getLogger(__name__)

SEND_BATCH_BYTES = 16 * 1024 * 1024
"""At most this many payload bytes per `send` call of a PutQueue."""


class Backend(Protocol):
    """What ColdTier needs from a cold store (a vault, Valkey / Redis, a set of shards)."""

    address: str
    """Where it is, for messages (never holds a password)."""

    def put(self, namespace: bytes, key: bytes, part: int, payload: bytes | memoryview) -> None:
        """Queue one payload and return at once; a full queue drops the oldest (counted)."""

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        """How many leading `keys` have every one of `parts` stored; 0 on any failure."""

    def promote(
        self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]
    ) -> dict[tuple[int, int], memoryview]:
        """(key index, part) → payload that passed its checksum; failures are absent."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued puts; False on timeout or when a put was lost since the last flush."""

    def stats(self) -> list[VaultStats]:
        """One row per server behind this backend; raises VaultUnavailable when one is down."""

    def clear(self, namespace: bytes) -> int:
        """Remove all of `namespace`; the entries removed. Raises VaultUnavailable."""

    def counters(self) -> dict[str, int | str]:
        """Client-side counters (dropped / failed / stored puts, breaker state...)."""

    def close(self) -> None:
        """Deliver what is queued (up to one deadline), then release connections and threads."""


class PendingPut(NamedTuple):
    namespace: bytes
    key: bytes
    part: int
    payload: bytes


class PutQueue:
    """Puts waiting for one sender thread; bounded by bytes, the oldest dropped when full.

    `send(batch)` stores a batch or raises; a raise counts the batch as failed and as a breaker
    failure. While the breaker is open, queued puts are dropped (counted) instead of sent.
    """

    def __init__(
        self,
        name: str,
        send: Callable[[list[PendingPut]], None],
        breaker: CircuitBreaker,
        max_pending_bytes: int,
    ) -> None:
        self._send = send
        self._breaker = breaker
        self.max_pending_bytes = max_pending_bytes
        self._cond = threading.Condition()
        self._pending: deque[PendingPut] = deque()
        self._held_bytes = 0  # queued or being sent
        self._in_flight = 0
        self._lost_since_flush = False
        self._closed = False
        self.dropped_puts = 0
        self.failed_puts = 0
        self.stored_puts = 0
        self._sender = threading.Thread(
            target=self._send_loop, name=f"tierkv-put-{name}", daemon=True
        )
        self._sender.start()

    def put(self, namespace: bytes, key: bytes, part: int, payload: bytes | memoryview) -> None:
        data = payload if isinstance(payload, bytes) else bytes(payload)
        with self._cond:
            while self._pending and self._held_bytes + len(data) > self.max_pending_bytes:
                self._held_bytes -= len(self._pending.popleft().payload)
                self._count_dropped(1)
            if self._closed or self._held_bytes + len(data) > self.max_pending_bytes:
                self._count_dropped(1)
                return
            self._pending.append(PendingPut(namespace, key, part, data))
            self._held_bytes += len(data)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            lost, self._lost_since_flush = self._lost_since_flush, False
            return not lost

    def counters(self) -> dict[str, int | str]:
        with self._cond:
            return {
                "dropped_puts": self.dropped_puts,
                "failed_puts": self.failed_puts,
                "stored_puts": self.stored_puts,
                "pending_bytes": self._held_bytes,
                "breaker": self._breaker.state,
            }

    def close(self, timeout: float) -> None:
        """Send what is queued (up to `timeout`), drop the rest, stop the sender."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._count_dropped(len(self._pending))
            self._pending.clear()
            self._cond.notify_all()
        self._sender.join(timeout)

    def _count_dropped(self, count: int) -> None:
        """Caller holds self._cond."""
        if count:
            self.dropped_puts += count
            self._lost_since_flush = True

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                if not self._breaker.allow():
                    self._count_dropped(len(self._pending))
                    self._pending.clear()
                    self._held_bytes = 0
                    self._cond.notify_all()
                    continue
                batch: list[PendingPut] = []
                batch_bytes = 0
                while self._pending and (not batch or batch_bytes < SEND_BATCH_BYTES):
                    batch.append(self._pending.popleft())
                    batch_bytes += len(batch[-1].payload)
                self._in_flight = len(batch)
            try:
                self._send(batch)
            except Exception as exc:
                log.debug("tierkv: %d puts failed: %s", len(batch), exc)
                self._breaker.record_failure()
                with self._cond:
                    self.failed_puts += len(batch)
                    self._lost_since_flush = True
            else:
                self._breaker.record_success()
                with self._cond:
                    self.stored_puts += len(batch)
            with self._cond:
                self._held_bytes -= batch_bytes
                self._in_flight = 0
                self._cond.notify_all()
