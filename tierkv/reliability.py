"""What every client of a cold store shares, written once: the circuit breaker and the put queue.

`CircuitBreaker`: after `failures` consecutive failures calls answer "miss" at once, until a
background probe succeeds. `PutQueue`: a byte-bounded queue that drops the oldest puts when full
and sends batches from one background thread through the client's `send`, counting every put
that is stored, refused by the store, failed or dropped. A put's payload may come in pieces the
caller hands over (a header and the block's own memory, not copied); the caller's `release` is
called once the put is done with them. The vault client and the Valkey / Redis backend use both;
nothing here knows a transport.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

from tierkv.logs import get_logger

log = get_logger(__name__)

SEND_BATCH_BYTES = 16 * 1024 * 1024
"""At most this many payload bytes per `send` call of a PutQueue, unless told otherwise."""


class CircuitBreaker:
    """Opens after `failures` consecutive failures; a background probe closes it again.

    While open, `allow()` is False. Every `cooldown_s` the probe calls `probe()` (which must
    honour its own deadline); the first success closes the breaker.
    """

    def __init__(self, failures: int, cooldown_s: float, probe: Callable[[], bool]) -> None:
        self._failures_to_open = failures
        self._cooldown_s = cooldown_s
        self._probe = probe
        self._lock = threading.Lock()
        self._consecutive_failures = 0
        self._open = False
        self._probing = False
        self._stopped = threading.Event()

    @property
    def state(self) -> str:
        """ "closed" (calls go through) or "open" (calls answer miss at once)."""
        return "open" if self._open else "closed"

    def allow(self) -> bool:
        return not self._open

    def record_success(self) -> None:
        with self._lock:
            self._consecutive_failures = 0
            self._open = False

    def record_failure(self) -> None:
        with self._lock:
            self._consecutive_failures += 1
            if self._consecutive_failures < self._failures_to_open:
                return
            self._open = True
            if self._probing:
                return
            self._probing = True
        threading.Thread(
            target=self._probe_until_closed, name="tierkv-breaker", daemon=True
        ).start()

    def stop(self) -> None:
        """End the background probe (on client close)."""
        self._stopped.set()

    def _probe_until_closed(self) -> None:
        while not self._stopped.wait(self._cooldown_s):
            if self._probe():
                self.record_success()
            with self._lock:
                if not self._open:
                    self._probing = False
                    return


Piece = bytes | memoryview
"""A piece of a payload: bytes, or a memoryview of bytes (format "B")."""
PutPayload = bytes | memoryview | tuple[Piece, ...]
"""What a put takes: a payload, or its pieces handed over (see PutQueue.put)."""


class PendingPut(NamedTuple):
    namespace: bytes
    key: bytes
    part: int
    pieces: tuple[Piece, ...]
    """The payload: one bytes object, or pieces handed over, to be sent one after the other."""
    size: int
    """Payload bytes (of every piece)."""
    release: Callable[[], None] | None = None
    """Called once, when the put is done with `pieces` (stored, refused, failed or dropped)."""


def payload_bytes(payload: PutPayload) -> int:
    """Bytes of a put's payload, of all its pieces when it comes in pieces."""
    pieces = payload if isinstance(payload, tuple) else (payload,)
    return sum(piece.nbytes if isinstance(piece, memoryview) else len(piece) for piece in pieces)


def released(puts: Iterable[PendingPut]) -> None:
    """Call the `release` of each of `puts` that has one (never under a queue's lock)."""
    for put in puts:
        if put.release is not None:
            put.release()


class PutQueue:
    """Puts waiting for one sender thread; bounded by bytes, the oldest dropped when full.

    `send(batch)` stores a batch of up to `batch_bytes` payload bytes and returns how many of
    its puts the store refused (0: all stored), or raises: the batch then counts as failed and
    `on_failure(exc)` is told (default: a breaker failure). While the breaker is open, queued
    puts are dropped (counted) instead of sent.
    """

    def __init__(
        self,
        name: str,
        send: Callable[[list[PendingPut]], int],
        breaker: CircuitBreaker,
        max_pending_bytes: int,
        *,
        batch_bytes: int = SEND_BATCH_BYTES,
        on_failure: Callable[[Exception], None] | None = None,
    ) -> None:
        self._send = send
        self._breaker = breaker
        self._on_failure = on_failure or (lambda exc: breaker.record_failure())
        self.max_pending_bytes = max_pending_bytes
        self._batch_bytes = batch_bytes
        self._cond = threading.Condition()
        self._pending: deque[PendingPut] = deque()
        self._held_bytes = 0  # queued or being sent
        self._in_flight = 0
        self._lost_since_flush = False
        self._closed = False
        self.dropped_puts = 0
        """Puts dropped before reaching the store (queue full, breaker open, queue closed)."""
        self.failed_puts = 0
        """Puts of a `send` that raised (store down or deadline)."""
        self.stored_puts = 0
        self.rejected_puts = 0
        """Puts the store answered but refused (counted by `send`'s return)."""
        self._sender = threading.Thread(
            target=self._send_loop, name=f"tierkv-put-{name}", daemon=True
        )
        self._sender.start()

    @property
    def pending_bytes(self) -> int:
        """Bytes of puts queued or being sent (at most max_pending_bytes)."""
        return self._held_bytes

    @property
    def in_flight_puts(self) -> int:
        """Puts of the `send` in progress, or dropped (breaker open) and being released."""
        return self._in_flight

    def put(
        self,
        namespace: bytes,
        key: bytes,
        part: int,
        payload: PutPayload,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Queue one put and return at once. A memoryview is copied first; a tuple of pieces is
        not: they are sent as they are, so their memory must not change until `release()` (called
        once the put is done with them, whatever its outcome; at once when it is dropped)."""
        if isinstance(payload, tuple):
            pieces = payload
        else:
            pieces = (payload if isinstance(payload, bytes) else bytes(payload),)
        size = payload_bytes(pieces)
        put = PendingPut(namespace, key, part, pieces, size, release)
        dropped = []
        with self._cond:
            while self._pending and self._held_bytes + size > self.max_pending_bytes:
                dropped.append(self._pending.popleft())
                self._held_bytes -= dropped[-1].size
                self._count_dropped(1)
            if self._closed or self._held_bytes + size > self.max_pending_bytes:
                dropped.append(put)
                self._count_dropped(1)
            else:
                self._pending.append(put)
                self._held_bytes += size
                self._cond.notify_all()
        released(dropped)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued put has been answered (stored or refused).

        False on timeout, or when some put was lost (dropped or failed) since the last flush.
        """
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
                "rejected_puts": self.rejected_puts,
                "pending_bytes": self._held_bytes,
                "in_flight_puts": self._in_flight,
                "breaker": self._breaker.state,
            }

    def close(self, timeout: float, send_timeout: float | None = None) -> None:
        """Send what is queued (up to `timeout`), drop the rest, and stop the sender, waiting
        up to `send_timeout` (default `timeout`) for a `send` still in progress."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._count_dropped(len(self._pending))
            dropped = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        released(dropped)
        self._sender.join(timeout if send_timeout is None else send_timeout)

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
                dropped: list[PendingPut] = []
                batch: list[PendingPut] = []
                batch_bytes = 0
                if not self._breaker.allow():
                    dropped.extend(self._pending)
                    self._count_dropped(len(dropped))
                    self._pending.clear()
                    self._held_bytes = 0
                while self._pending and (not batch or batch_bytes < self._batch_bytes):
                    batch.append(self._pending.popleft())
                    batch_bytes += batch[-1].size
                self._in_flight = len(batch) + len(dropped)  # flush waits for their release
            if dropped:
                released(dropped)
                with self._cond:
                    self._in_flight = 0
                    self._cond.notify_all()
                continue
            try:
                rejected = self._send(batch)
            except Exception as exc:
                log.debug("%d puts failed: %s", len(batch), exc)
                self._on_failure(exc)
                with self._cond:
                    self.failed_puts += len(batch)
                    self._lost_since_flush = True
            else:
                self._breaker.record_success()
                with self._cond:
                    self.stored_puts += len(batch) - rejected
                    self.rejected_puts += rejected
            released(batch)
            with self._cond:
                self._held_bytes -= batch_bytes
                self._in_flight = 0
                self._cond.notify_all()
