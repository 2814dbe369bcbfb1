"""A tierkv vault as a Backend: its client, with fire-and-forget puts, deadline-bound lookups and
promotes, and a breaker.

`put` never blocks: blocks wait in a queue bounded by bytes (the oldest are dropped and counted
when it is full) and a background thread sends them to the vault (reliability.PutQueue).
`lookup` and `promote` never raise and never wait past their deadline: any failure is a miss.
After `breaker_failures` consecutive failed calls the circuit breaker opens: calls answer "miss"
at once and queued puts are dropped, while a background probe checks the vault's health every
`breaker_cooldown_s` and closes the breaker when it answers again (gRPC reconnects by itself).

Put and Promote payloads travel over the vault's bulk data path (vault_bulk.py: plain TCP, a few
pooled connections) when the vault offers one and its port answers, else over gRPC streams;
lookups and management calls always use gRPC. A call that fails on the bulk path counts as a
failure toward the breaker, and so does a bulk connection refused or not welcomed in time; the
bulk path is then left alone for a cooldown. A connection the vault refuses with a reason (its
tenant holds its limit of connections: a busy vault, not a failed one) is counted in
`bulk_refusals` instead, and the call goes over gRPC. When the vault refused (a busy vault
closing the connection, a malformed reply) rather than not answering a call in time, the call is
tried again over gRPC in the time it has left.

A block larger than the vault takes on any path (its Hello tells the largest bulk frame and gRPC
message) is the caller's error, not the vault's: it is refused before it is sent, counted
(`oversized_puts`, and as rejected) and leaves the breaker alone; so is a Put stream that a vault
too old to tell ends RESOURCE_EXHAUSTED for a message larger than its maximum.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import grpc.experimental
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierkv.addresses import parse_address
from tierkv.backends.base import BackendStats, BackendUnavailable, StorageTierStats
from tierkv.backends.security import (
    channel_credentials,
    check_client_security,
    client_token,
    proving_channel,
    ssl_context,
)
from tierkv.backends.vault_bulk import (
    MIN_PUT_BLOCKS_PER_S,
    BulkConnection,
    BulkError,
    BulkRefused,
)
from tierkv.checksum import address_prefix, block_checksum, checksum_at
from tierkv.config import ClientConfig, SecurityConfig
from tierkv.reliability import CircuitBreaker, PendingPut, Piece, PutPayload, PutQueue
from tierkv.sizes import KIB, MIB
from tierkv.transfer import Into, batched_by_size
from tierkv.wire._pb import vault_pb2, vault_pb2_grpc
from tierkv.wire.messages import (
    CHANNEL_OPTIONS,
    already_encoded,
    decode_bulk,
    encode_bulk,
    split_payloads,
)

PUT_BATCH_BYTES = 256 * KIB
"""Small payloads are batched up to this many bytes per PutBatch; larger ones go alone, which
lets the vault keep the received message as the stored payload without copying it."""
PUT_STREAM_BYTES = 128 * MIB
"""At most this many payload bytes per Put stream (each stream gets its own deadline)."""
BULK_PUT_FRAME_BYTES = 16 * MIB
"""Payload bytes per PUT frame on the bulk path (the vault stores one while the next arrives)."""
MAX_BLOCKS_PER_BATCH = 16384
"""Blocks per PutBatch or PUT frame (a vault refuses more than limits.max_blocks_per_request)."""
PUT_MESSAGE_FRAMING_BYTES = 64
"""What a gRPC Put message of one block adds to its payload, namespace and key (protobuf tags,
lengths, part and checksum), for the check against the vault's max_message_bytes."""
MIN_PUT_BYTES_PER_S = 50e6
"""A Put stream's deadline is deadline_s plus its bytes at this rate, plus its blocks at
vault_bulk.MIN_PUT_BLOCKS_PER_S."""
CLIENT_OPTIONS = [
    *CHANNEL_OPTIONS,
    # Reconnect quickly after a vault restarts (gRPC's default backoff grows to 2 minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Promote streams are read on the calling thread, without a hand-off thread (less CPU).
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
]
MAX_IDLE_BULK_CONNECTIONS = 4
T = TypeVar("T")
_METHOD = "/" + vault_pb2.DESCRIPTOR.services_by_name["Vault"].full_name + "/"


class VaultRefused(BackendUnavailable):
    """The vault requires a token and refused ours (or we have none)."""


class _StallGuard:
    """Cancels a streaming call when no message arrives for `idle_s` seconds (a hung vault)."""

    def __init__(self, call: grpc.RpcContext, idle_s: float) -> None:
        self._call = call
        self._idle_s = idle_s
        self._last = time.monotonic()
        self._finished = threading.Event()
        threading.Thread(target=self._watch, name="tierkv-stall-guard", daemon=True).start()

    def progress(self) -> None:
        self._last = time.monotonic()

    def done(self) -> None:
        self._finished.set()

    def _watch(self) -> None:
        while not self._finished.wait(self._idle_s / 4):
            if time.monotonic() - self._last > self._idle_s:
                self._call.cancel()
                return


class VaultClient:
    """One vault at `address` ("host:port"); thread-safe; see the module docstring."""

    def __init__(
        self,
        address: str,
        *,
        deadline_s: float = 2.0,
        promote_deadline_s: float = 30.0,
        max_pending_bytes: int = 256 * MIB,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 5.0,
        token: str | None = None,
        security: SecurityConfig | None = None,
    ) -> None:
        self._host = parse_address(address)[0]  # a clear ValueError for a malformed address
        self.address = address
        self.deadline_s = deadline_s
        self.promote_deadline_s = promote_deadline_s
        self.max_pending_bytes = max_pending_bytes
        self._token = token
        security = security or SecurityConfig()
        self._tls = ssl_context(security)
        credentials = channel_credentials(security)
        if credentials is None:
            channel = grpc.insecure_channel(address, options=CLIENT_OPTIONS)
        else:
            channel = grpc.secure_channel(address, credentials, options=CLIENT_OPTIONS)
        self._channel = proving_channel(channel, token)  # a fresh call proof on every call
        self._stub = vault_pb2_grpc.VaultStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # The bulk methods bypass per-message protobuf copies (see wire/messages.py).
        self._put_call = self._channel.stream_unary(
            _METHOD + "Put",
            request_serializer=already_encoded,
            response_deserializer=vault_pb2.PutSummary.FromString,
        )
        self._promote_call = self._channel.unary_stream(
            _METHOD + "Promote",
            request_serializer=vault_pb2.PromoteRequest.SerializeToString,
            response_deserializer=_decode_promote_chunk,
        )
        self._breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s, self._is_serving)
        self._bulk_lock = threading.Lock()
        self._idle_bulk: list[BulkConnection] = []
        self._bulk_retry_at = 0.0
        self._bulk_retry_s = breaker_cooldown_s
        self._hello: vault_pb2.HelloReply | None = None
        """The vault's latest answer to Hello (its bulk port and largest Put); None: not asked."""

        self._lock = threading.Lock()
        self._closed = False
        self.last_rejections: list[str] = []
        """Reasons the vault gave for the rejections of the latest Put stream."""
        self.checksum_failures = 0
        """Promoted payloads whose checksum did not match (returned as misses)."""
        self.failed_calls = 0
        self.oversized_puts = 0
        """Puts refused as larger than the vault takes (the caller's error, not the vault's)."""
        self.bulk_refusals = 0
        """Bulk connections the vault refused with a reason (a connection limit): gRPC then."""
        self.transport = "none"
        """What carried the latest successful Put or Promote: "bulk", "grpc" or "none" yet."""
        self._queue = PutQueue(
            address,
            self._send_stream,
            self._breaker,
            max_pending_bytes,
            batch_bytes=PUT_STREAM_BYTES,
            on_failure=self._stream_failed,
        )

    @classmethod
    def from_config(
        cls, address: str, client_cfg: ClientConfig, security: SecurityConfig | None = None
    ) -> VaultClient:
        """A client using the `[client]` and `[security]` sections of tierkv.toml (its token:
        $TIERKV_TOKEN, else security.token_file)."""
        security = security or SecurityConfig()
        check_client_security(security)
        return cls(
            address,
            deadline_s=client_cfg.deadline_ms / 1000,
            promote_deadline_s=client_cfg.promote_deadline_ms / 1000,
            max_pending_bytes=client_cfg.max_pending_bytes,
            breaker_failures=client_cfg.breaker_failures,
            breaker_cooldown_s=client_cfg.breaker_cooldown_s,
            token=client_token(security),
            security=security,
        )

    @property
    def breaker_state(self) -> str:
        """ "closed" or "open"."""
        return self._breaker.state

    @property
    def dropped_puts(self) -> int:
        """Puts dropped before reaching the vault (queue full, breaker open, client closed)."""
        return self._queue.dropped_puts

    @property
    def failed_puts(self) -> int:
        """Puts sent on a stream that failed (vault down or deadline)."""
        return self._queue.failed_puts

    @property
    def stored_puts(self) -> int:
        return self._queue.stored_puts

    @property
    def rejected_puts(self) -> int:
        return self._queue.rejected_puts

    @property
    def in_flight_puts(self) -> int:
        """Puts on a Put stream that the vault has not answered yet."""
        return self._queue.in_flight_puts

    @property
    def pending_bytes(self) -> int:
        """Bytes of puts queued or being sent (at most max_pending_bytes)."""
        return self._queue.pending_bytes

    # ---- puts --------------------------------------------------------------------------------

    def put(
        self,
        namespace: bytes,
        key: bytes,
        part: int,
        payload: PutPayload,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Queue a block for the vault and return at once (a memoryview is copied first; pieces
        are sent as they are, then `release()` is called: see PutQueue.put)."""
        self._queue.put(namespace, key, part, payload, release)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued put has been answered by the vault (stored or rejected).

        False on timeout, or when some put was lost (dropped or failed) since the last flush.
        """
        return self._queue.flush(timeout)

    def _send_stream(self, stream: list[PendingPut]) -> int:
        """Store one stream of puts over the bulk path, else gRPC; how many were rejected (by
        the vault, or here as larger than it takes). Raises grpc.RpcError or BulkError when the
        stream failed."""
        stream_bytes = sum(put.size for put in stream)
        deadline = (
            time.monotonic()
            + self.deadline_s
            + stream_bytes / MIN_PUT_BYTES_PER_S
            + len(stream) / MIN_PUT_BLOCKS_PER_S
        )
        hello = self._hello or self._ask_hello(deadline)
        checked = [(put, _oversize(put, hello)) for put in stream]
        oversized = [reason for _, reason in checked if reason]
        if oversized:
            stream = [put for put, reason in checked if not reason]
            with self._lock:
                self.oversized_puts += len(oversized)
                self.last_rejections = oversized
            if not stream:
                return len(oversized)
        summaries = None
        if not hello.max_message_bytes or all(p.size <= hello.max_frame_bytes for p in stream):
            summaries = self._put_bulk(stream, deadline)  # else a block only gRPC can carry
        transport = "bulk"
        if summaries is None:
            timeout = deadline - time.monotonic()
            summaries = [self._put_call(_put_batches(stream), timeout=timeout)]
            transport = "grpc"
        with self._lock:
            self.transport = transport
            self.last_rejections = oversized + [
                r.reason for summary in summaries for r in summary.rejections
            ]
        return len(oversized) + len(stream) - sum(summary.stored for summary in summaries)

    def _ask_hello(self, deadline: float) -> vault_pb2.HelloReply:
        """The vault's answer to Hello, asked by `deadline` (before its first Put stream)."""
        wait_s = min(self.deadline_s, deadline - time.monotonic())
        self._bulk_port(vault_pb2.HelloRequest(), timeout=wait_s)
        return self._hello or vault_pb2.HelloReply()

    def _stream_failed(self, exc: Exception) -> None:
        """A Put stream failed: a failure toward the breaker (a bulk failure was counted when
        it happened), unless the vault refused a message as larger than it takes."""
        if _refused_as_too_large(exc):
            with self._lock:
                self.oversized_puts += 1
        elif not isinstance(exc, BulkError):
            self._record_failure()

    def _put_bulk(
        self, stream: list[PendingPut], deadline: float
    ) -> list[vault_pb2.PutSummary] | None:
        """Send `stream` over the bulk path; None: use gRPC (no bulk path, or it failed)."""

        def frames() -> Iterator[tuple[vault_pb2.PutIndex, list[Piece]]]:
            """Frames no larger than the vault takes (it told that by now: Hello gave its port)."""
            largest = (self._hello.max_frame_bytes if self._hello else 0) or BULK_PUT_FRAME_BYTES
            for batch in batched_by_size(
                stream,
                lambda p: p.size,
                min(BULK_PUT_FRAME_BYTES, largest),
                lambda p: p.namespace,
                MAX_BLOCKS_PER_BATCH,
            ):
                yield _put_index(batch), [piece for p in batch for piece in p.pieces]

        return self._on_bulk(deadline, lambda connection: connection.put(frames(), deadline))

    # ---- reads -------------------------------------------------------------------------------

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        """How many leading `keys` have every one of `parts` stored; 0 on any failure."""
        if not keys or not self._breaker.allow():
            return 0
        request = vault_pb2.LookupRequest(namespace=namespace, keys=keys, parts=parts)
        try:
            reply = self._stub.Lookup(request, timeout=self.deadline_s)
        except grpc.RpcError:
            self._record_failure()
            return 0
        self._breaker.record_success()
        return min(reply.present, len(keys))

    def promote(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts: Sequence[int],
        into: Into | None = None,
    ) -> dict[tuple[int, int], memoryview]:
        """(key index, part) → verified payload for every block the vault returned in time.

        Payloads are zero-copy views of the received chunks. With `into`, a payload the bulk
        path receives straight into the buffers `into(key indices, parts)` gives for it is
        returned as the first of them (that very object; the gRPC path ignores `into`); the
        buffers of a payload that is then absent may hold anything. Missing, checksum-failed
        and failed-call blocks are simply absent; this never raises (any failure, MemoryError
        included, is a miss and a counted failure). The whole call is bounded by
        promote_deadline_s, and a vault that sends nothing for deadline_s is given up on.
        """
        found: dict[tuple[int, int], memoryview] = {}
        if not keys or not parts or not self._breaker.allow():
            return found
        deadline = time.monotonic() + self.promote_deadline_s
        prefixes = {part: address_prefix(namespace, part) for part in parts}  # the wanted ones
        bad_checksums = 0

        def verify(
            index: vault_pb2.PromoteIndex, first: int, payloads: list[list[memoryview]]
        ) -> None:
            """Keep the payloads at positions first.. of `index` that pass their checksum."""
            nonlocal bad_checksums
            end = first + len(payloads)
            for key_index, part, pieces, checksum in zip(
                index.key_indices[first:end],
                index.parts[first:end],
                payloads,
                index.checksums[first:end],
                strict=False,
            ):
                prefix = prefixes.get(part)
                if prefix is None or key_index >= len(keys):
                    continue
                if checksum_at(prefix + keys[key_index], pieces, hold_gil=True) != checksum:
                    bad_checksums += 1
                    continue
                found[(key_index, part)] = pieces[0]

        try:
            request = vault_pb2.PromoteRequest(namespace=namespace, keys=keys, parts=parts)
            transport = "bulk"
            if self._promote_bulk(request, deadline, verify, into) is None:
                found.clear()  # what a failed bulk call verified: gRPC sends it again
                transport = "grpc"
                for index, payloads in self._promote_grpc(request, deadline):
                    verify(index, 0, payloads)
        except BulkError:  # timed out on the bulk path: counted already
            found = {}
        except Exception:  # the promise: never raise, whatever the vault or the machine does
            found = {}
            self._record_failure()
        else:
            self._breaker.record_success()
            self.transport = transport
        if bad_checksums:
            with self._lock:
                self.checksum_failures += bad_checksums
        return found

    def _promote_bulk(
        self,
        request: vault_pb2.PromoteRequest,
        deadline: float,
        received: Callable[[vault_pb2.PromoteIndex, int, list[list[memoryview]]], None],
        into: Into | None,
    ) -> vault_pb2.PromoteIndex | None:
        """The Promote over the bulk path, payloads handed to `received` as they arrive; None:
        use gRPC (none, or it failed)."""
        return self._on_bulk(
            deadline, lambda connection: connection.promote(request, deadline, received, into)
        )

    def _on_bulk(self, deadline: float, call: Callable[[BulkConnection], T]) -> T | None:
        """`call` on a bulk connection; None: use gRPC (no bulk path, or the vault refused)."""
        connection = self._bulk_connection(deadline)
        if connection is None:
            return None
        try:
            result = call(connection)
        except BulkError as exc:
            self._bulk_failed(exc)
            return None
        self._release_bulk(connection)
        return result

    def _promote_grpc(
        self, request: vault_pb2.PromoteRequest, deadline: float
    ) -> Iterator[tuple[vault_pb2.PromoteIndex, list[list[memoryview]]]]:
        """The gRPC Promote stream as (index, payloads) chunks, each payload one view; a
        stalled stream is cancelled."""
        call = self._promote_call(request, timeout=deadline - time.monotonic())
        guard = _StallGuard(call, self.deadline_s)
        try:
            for index, data in call:
                guard.progress()
                yield index, [[view] for view in split_payloads(data, index.lengths)]
        finally:
            guard.done()

    # ---- bulk data path ------------------------------------------------------------------------

    def _bulk_connection(self, deadline: float) -> BulkConnection | None:
        """An idle or new connection to the vault's bulk port; None when gRPC must carry the call
        (the vault has no bulk path, or its port did not answer lately). Raises grpc.RpcError
        when the vault does not answer at all by `deadline`."""
        with self._bulk_lock:
            while self._idle_bulk:
                connection = self._idle_bulk.pop()
                if connection.is_open():
                    return connection
                connection.close()  # the vault restarted or dropped it
            if time.monotonic() < self._bulk_retry_at:
                return None
        wait_s = min(self.deadline_s, deadline - time.monotonic())
        port = self._bulk_port(vault_pb2.HelloRequest(), timeout=wait_s)
        if port:
            try:
                return self._connect_bulk(port, min(self.deadline_s, deadline - time.monotonic()))
            except BulkRefused:  # at a connection limit: gRPC, no failure
                with self._lock:
                    self.bulk_refusals += 1
            except BulkError:  # refused, a handshake timeout, or a firewall: a failure, then gRPC
                self._record_failure()
        self._bulk_failed(None)
        return None

    def _connect_bulk(self, port: int, timeout_s: float) -> BulkConnection:
        """A new authenticated bulk connection; BulkError when refused or unreachable."""
        return BulkConnection(self._host, port, timeout_s, self._token, self._tls)

    def _bulk_failed(self, error: BulkError | None) -> None:
        """Leave the bulk path alone for a cooldown. A failed call (`error`) also counts as a
        failure, and is raised again when the vault did not answer in time (no point in trying
        gRPC then); else the caller falls back to gRPC."""
        with self._bulk_lock:
            self._bulk_retry_at = time.monotonic() + self._bulk_retry_s
        if error is not None:
            self._record_failure()
            if error.timed_out:
                raise error

    def _bulk_port(self, request: vault_pb2.HelloRequest, **options: Any) -> int:
        """The vault's bulk port (Hello, called with `options`, its answer kept); 0 when it has
        none or predates Hello (gRPC alone)."""
        try:
            self._hello = self._stub.Hello(request, **options)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._hello = vault_pb2.HelloReply()
                return 0
            raise
        return int(self._hello.bulk_port)

    def _release_bulk(self, connection: BulkConnection) -> None:
        """Keep a connection whose call succeeded for the next call (a few at most)."""
        with self._bulk_lock:
            if len(self._idle_bulk) < MAX_IDLE_BULK_CONNECTIONS and not self._closed:
                self._idle_bulk.append(connection)
                return
        connection.close()

    # ---- management --------------------------------------------------------------------------

    def stats(self) -> BackendStats:
        """The vault's counters; raises BackendUnavailable when it does not answer in time."""
        started = time.monotonic()
        reply = self._management_call(self._stub.Stats, vault_pb2.StatsRequest())
        return backend_stats(self.address, reply, time.monotonic() - started)

    def server_stats(self) -> list[BackendStats]:
        """The Backend protocol's view of `stats`: this vault's one row."""
        return [self.stats()]

    def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Remove every part of `keys`; the number of entries removed. Raises BackendUnavailable."""
        request = vault_pb2.DeleteRequest(namespace=namespace, keys=keys)
        return int(self._management_call(self._stub.Delete, request).deleted)

    def clear(self, namespace: bytes) -> int:
        """Remove all of `namespace`; the number of entries removed. Raises BackendUnavailable."""
        request = vault_pb2.ClearRequest(namespace=namespace)
        return int(self._management_call(self._stub.Clear, request).deleted)

    def bulk_path(self) -> tuple[int, bool]:
        """(bulk port, reachable from here) of the vault; port 0 = it has none.

        Raises BackendUnavailable when the vault does not answer over gRPC.
        """
        port = self._management_call(self._bulk_port, vault_pb2.HelloRequest())
        if not port:
            return 0, False
        try:
            self._connect_bulk(port, self.deadline_s).close()
        except BulkRefused:
            return port, True  # it answered: busy (at a connection limit), but reachable
        except BulkError:
            return port, False
        return port, True

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the vault to report SERVING."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._is_serving(min(self.deadline_s, max(deadline - time.monotonic(), 0.01))):
                return True
            time.sleep(0.05)
        return False

    def counters(self) -> dict[str, int | str]:
        """The client-side counters, for stats pages."""
        with self._lock:
            mine: dict[str, int | str] = {
                "checksum_failures": self.checksum_failures,
                "failed_calls": self.failed_calls,
                "oversized_puts": self.oversized_puts,
                "bulk_refusals": self.bulk_refusals,
                "transport": self.transport,
            }
        return {**self._queue.counters(), **mine}

    def close(self) -> None:
        """Deliver what is queued (up to one deadline), then stop the threads and the channel."""
        self._queue.close(self.deadline_s, self.deadline_s + PUT_STREAM_BYTES / MIN_PUT_BYTES_PER_S)
        self._breaker.stop()
        with self._bulk_lock:
            self._closed = True
            for connection in self._idle_bulk:
                connection.close()
            self._idle_bulk.clear()
        self._channel.close()

    def __enter__(self) -> VaultClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- helpers -----------------------------------------------------------------------------

    def _record_failure(self) -> None:
        with self._lock:
            self.failed_calls += 1
        self._breaker.record_failure()

    def _management_call(self, method: Callable[..., Any], request: object) -> Any:
        try:
            return method(request, timeout=self.deadline_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                given = (
                    f"ours was refused ({exc.details()})"
                    if self._token
                    else "we have none ($TIERKV_TOKEN)"
                )
                raise VaultRefused(
                    f"vault at {self.address} requires a token and {given}"
                ) from None
            raise BackendUnavailable(
                f"vault at {self.address} did not answer: {exc.code().name} {exc.details()}"
            ) from None

    def _is_serving(self, timeout: float | None = None) -> bool:
        """Health check that waits for the connection (gRPC reconnects) up to the deadline."""
        request = health_pb2.HealthCheckRequest(service="")
        try:
            reply = self._health.Check(
                request,
                timeout=timeout or self.deadline_s,
                wait_for_ready=True,
            )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _oversize(put: PendingPut, hello: vault_pb2.HelloReply) -> str | None:
    """Why the vault that gave `hello` takes `put` on no path (too large for a bulk frame and a
    gRPC message); None when it may, or did not say."""
    message_bytes = put.size + len(put.namespace) + len(put.key) + PUT_MESSAGE_FRAMING_BYTES
    if not hello.max_message_bytes or message_bytes <= hello.max_message_bytes:
        return None
    if put.size <= hello.max_frame_bytes:
        return None
    return (
        f"block of {put.size} bytes exceeds what the vault takes (a bulk PUT frame of"
        f" {hello.max_frame_bytes} bytes, a gRPC message of {hello.max_message_bytes} bytes)"
    )


def _refused_as_too_large(exc: Exception) -> bool:
    """Whether a failed Put stream was the vault refusing a message larger than its maximum."""
    return (
        isinstance(exc, grpc.RpcError)
        and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "larger than max" in (exc.details() or "")
    )


def _decode_promote_chunk(buf: bytes) -> tuple[vault_pb2.PromoteIndex, memoryview]:
    return decode_bulk(buf, vault_pb2.PromoteIndex, vault_pb2.PromoteChunk)


def _put_index(batch: Sequence[PendingPut]) -> vault_pb2.PutIndex:
    """The index of one batch of a single namespace, with the writer's checksums."""
    return vault_pb2.PutIndex(
        namespace=batch[0].namespace,
        keys=[p.key for p in batch],
        parts=[p.part for p in batch],
        lengths=[p.size for p in batch],
        checksums=[
            block_checksum(p.namespace, p.key, p.part, *p.pieces, hold_gil=True) for p in batch
        ],
    )


def _put_batches(stream: list[PendingPut]) -> Iterator[bytes]:
    """Serialised PutBatch messages of one namespace and about PUT_BATCH_BYTES each."""
    for batch in batched_by_size(
        stream,
        lambda p: p.size,
        PUT_BATCH_BYTES,
        lambda p: p.namespace,
        MAX_BLOCKS_PER_BATCH,
    ):
        yield encode_bulk(_put_index(batch), [piece for p in batch for piece in p.pieces])


def backend_stats(address: str, reply: vault_pb2.StatsReply, rtt_s: float) -> BackendStats:
    """BackendStats of a vault's StatsReply: every field of the same name (vault.proto and
    BackendStats / StorageTierStats agree on the names), an absent tier None."""
    found: dict[str, Any] = {"address": address, "rtt_s": rtt_s}
    for field in dataclasses.fields(BackendStats):
        if field.name in ("ram", "disk"):
            tier = getattr(reply, field.name)
            found[field.name] = (
                StorageTierStats(*(getattr(tier, name) for name in StorageTierStats._fields))
                if reply.HasField(field.name)
                else None
            )
        elif field.name not in found:
            found[field.name] = getattr(reply, field.name)
    return BackendStats(**found)
