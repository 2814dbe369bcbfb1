"""The vault's end of the bulk data path: Put and Promote frames over a plain TCP connection
beside gRPC (framing: tierkv/wire/framing.py; the client's end: tierkv/backends/vault_bulk.py).

`BulkServer(host, port, handler, ...)` listens and answers frames on a thread per connection,
calling `handler.put_blocks` / `handler.promote_blocks`; `stop()` closes everything. The vault
receives each stored payload into memory of its own.
A PUT frame is answered once its blocks are durable (with a disk tier: written); while the next
frame is already arriving, it is received and stored first, so the disk writes one frame while
the next comes in (replies keep their order).
Each connection starts with the vault's challenge (auth.py: the client proves its token, and so
its tenant, before any frame), over TLS when the vault has a certificate.
Connections are limited in all and per client address from the moment they are accepted (one
beyond is closed at once), and, on a vault of several tenants, per tenant once the handshake says
whose they are: one beyond its tenant's limits.max_connections_per_tenant is refused with a
reason (WELCOME's `refused`) and closed, so one tenant cannot hold every connection of an address
or of the vault. An authenticated connection idle for limits.idle_timeout_s is closed (clients
reconnect), one that has not authenticated within limits.handshake_timeout_s too.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from tierkv.config import LimitsConfig
from tierkv.sizes import KIB
from tierkv.transfer import batched_by_size
from tierkv.vault.auth import OPEN, Access, Tenant
from tierkv.vault.limits import (
    ByteBudget,
    Slots,
    max_put_index_bytes,
    request_problem,
)
from tierkv.vault.metrics import VaultMetrics
from tierkv.wire._pb import vault_pb2
from tierkv.wire.framing import (
    AUTH,
    CHALLENGE,
    HEADER,
    PROMOTE,
    PROMOTE_REPLY,
    PUT,
    PUT_REPLY,
    WELCOME,
    Deadline,
    Payload,
    check_lengths,
    empty_buffer,
    parse_header,
    parse_message,
    recv_bytes,
    recv_into,
    send_frame,
)
from tierkv.wire.messages import split_payloads
from tierkv.wire.proofs import NONCE_BYTES

SMALL_RUN_BYTES = 256 * KIB
"""The vault receives payloads smaller than this in runs that it splits with one copy, which
costs less than a system call per payload."""
MAX_AUTH_BYTES = 1024
"""Larger AUTH frames are protocol errors (a proof is 32 bytes)."""
MIN_FRAME_BYTES_PER_S = 1e6
"""The vault gives a frame limits.stall_timeout_s plus its bytes at this rate to arrive or leave
(a peer trickling bytes is dropped then, however steady the trickle)."""


class BulkHandler(Protocol):
    """What the vault does with the frames (server.VaultServicer implements it)."""

    def put_blocks(
        self, index: vault_pb2.PutIndex, payloads: Sequence[Payload], tenant: Tenant
    ) -> Callable[[], vault_pb2.PutSummary]: ...

    def promote_blocks(
        self, request: vault_pb2.PromoteRequest, tenant: Tenant
    ) -> tuple[vault_pb2.PromoteIndex, list[Payload]]: ...

    @property
    def metrics(self) -> VaultMetrics: ...


def _recv_put_payloads(
    sock: socket.socket, lengths: Sequence[int], deadline: Deadline
) -> list[Payload]:
    """The payloads of a PUT frame, each in memory of its own (evicting one frees it)."""
    payloads: list[Payload] = []
    for run in batched_by_size(list(lengths), int, SMALL_RUN_BYTES):
        buf = empty_buffer(sum(run))
        recv_into(sock, buf, deadline)
        if len(run) == 1:
            payloads.append(buf.toreadonly())
        else:
            payloads.extend(bytes(payload) for payload in split_payloads(buf, run))
    return payloads


class _Unanswered(NamedTuple):
    """A stored PUT frame whose reply is not sent yet."""

    answer: Callable[[], vault_pb2.PutSummary]  # waits until its blocks are durable
    deadline: Deadline
    data_len: int
    started: float


def _readable(sock: socket.socket) -> bool:
    """Whether bytes from the peer wait on `sock` (poll: any descriptor number)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class BulkServer:
    """Answers bulk frames on `host`:`port` (0: any free port; `.port` tells which), held to
    `limits`: PUT payloads are received only once `inflight` has room for them, and a frame whose
    payload exceeds it or `max_bytes` (the vault's cap; 0: none) is refused from its header."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: BulkHandler,
        limits: LimitsConfig,
        inflight: ByteBudget,
        max_bytes: int = 0,
        access: Access | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self._listener = socket.socket(family, kind, proto)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(sockaddr)
            self._listener.listen(limits.max_connections)
        except OSError:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._handler = handler
        self._limits = limits
        self._tokens = access.tokens if access else None
        self._tls = tls
        self.max_index_bytes = min(max_put_index_bytes(limits), limits.max_inflight_bytes // 2)
        """Bytes of the largest PUT index received (refused from the header beyond it)."""
        self.max_frame_bytes = min(inflight.per_holder, max_bytes or sys.maxsize)
        """Payload bytes of the largest PUT frame received (Hello tells clients): within a
        tenant's share of limits.max_inflight_bytes, so no frame holds all of it."""
        self._inflight = inflight
        self._slots = Slots(limits.max_connections, limits.max_connections_per_client)
        self._tenant_slots = Slots(limits.max_connections, limits.max_connections_per_tenant)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._stopped = False
        threading.Thread(target=self._accept_loop, name="tierkv-bulk-accept", daemon=True).start()

    def stop(self) -> None:
        """Stop listening and close every connection (a frame in progress fails)."""
        with self._lock:
            self._stopped = True
            connections = list(self._connections)
        for sock in [self._listener, *connections]:
            with contextlib.suppress(OSError):  # already disconnected
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # the listener was closed by stop()
            address = peer[0]
            with self._lock:
                refused = self._stopped or not self._slots.take(address)
                if not refused:
                    self._connections.add(sock)
            if refused:
                sock.close()
                if not self._stopped:
                    self._handler.metrics.refused("connection_limit")
                continue
            self._handler.metrics.connection_opened()
            threading.Thread(
                target=self._serve_connection,
                args=(sock, address),
                name="tierkv-bulk",
                daemon=True,
            ).start()

    def _serve_connection(self, sock: socket.socket, address: str) -> None:
        limits = self._limits
        tenant: Tenant | None = None  # once welcomed
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if self._tls is not None:
                sock.settimeout(limits.handshake_timeout_s)
                wrapped = self._tls.wrap_socket(sock, server_side=True)  # detaches `sock`
                with self._lock:
                    self._connections.discard(sock)
                    self._connections.add(wrapped)
                sock = wrapped
            tenant = self._handshake(sock)
            unanswered: _Unanswered | None = None
            while True:
                if unanswered is not None and not _readable(sock):
                    self._reply(sock, unanswered)
                    unanswered = None
                head = bytearray(HEADER.size)
                sock.settimeout(limits.idle_timeout_s)
                if sock.recv_into(memoryview(head)[:1]) == 0:
                    return  # the client closed its (idle) connection
                stall = Deadline(time.monotonic() + limits.stall_timeout_s, limits.stall_timeout_s)
                recv_into(sock, memoryview(head)[1:], stall)
                unanswered = self._answer_frame(sock, parse_header(bytes(head)), tenant, unanswered)
        except (OSError, ValueError, MemoryError):
            return  # peer gone, idle, stalled, malformed, too large or refused: drop it
        finally:
            with self._lock:
                self._connections.discard(sock)
                self._slots.give_back(address)
            if tenant is not None and tenant.prefix:
                self._tenant_slots.give_back(tenant.name)
            sock.close()
            self._handler.metrics.connection_closed()

    def _handshake(self, sock: socket.socket) -> Tenant:
        """Challenge and proof within handshake_timeout_s: the peer's tenant, holding one of its
        tenant's connection slots (on a vault of several tenants); ValueError when its proof
        matches no token, or after a refusal when its tenant holds all of its slots."""
        timeout_s = self._limits.handshake_timeout_s
        clock = Deadline(time.monotonic() + timeout_s, timeout_s)
        nonce = os.urandom(NONCE_BYTES)
        challenge = vault_pb2.BulkChallenge(nonce=nonce, auth_required=self._tokens is not None)
        send_frame(sock, CHALLENGE, challenge, clock)
        _, index_len, data_len = parse_header(recv_bytes(sock, HEADER.size, clock), AUTH)
        if data_len or index_len > MAX_AUTH_BYTES:
            raise ValueError("malformed AUTH frame")
        answer = parse_message(vault_pb2.BulkAuth, recv_bytes(sock, index_len, clock)).proof
        tenant = OPEN if self._tokens is None else self._tokens.tenant_of_proof(nonce, answer)
        if tenant is None:
            self._handler.metrics.auth_failed("bulk")
            raise ValueError("wrong token")
        if tenant.prefix and not self._tenant_slots.take(tenant.name):
            self._handler.metrics.refused("tenant_connection_limit")
            refusal = (
                f"tenant {tenant.name} already holds its limit of"
                f" {self._limits.max_connections_per_tenant} bulk connections"
                " (limits.max_connections_per_tenant)"
            )
            send_frame(sock, WELCOME, vault_pb2.BulkChallenge(refused=refusal), clock)
            raise ValueError(refusal)
        try:
            send_frame(sock, WELCOME, vault_pb2.BulkChallenge(), clock)
        except BaseException:
            if tenant.prefix:
                self._tenant_slots.give_back(tenant.name)
            raise
        return tenant

    def _reply(self, sock: socket.socket, put: _Unanswered) -> None:
        """Send a stored PUT frame's summary once its blocks are durable."""
        send_frame(sock, PUT_REPLY, put.answer(), put.deadline)
        elapsed = time.perf_counter() - put.started
        self._handler.metrics.call("put", "bulk", put.data_len, elapsed)

    def _answer_frame(
        self,
        sock: socket.socket,
        header: tuple[int, int, int],
        tenant: Tenant,
        unanswered: _Unanswered | None,
    ) -> _Unanswered | None:
        """Handle one frame; `unanswered` (the previous PUT, stored) is answered before this
        frame's reply. Returns this frame when it is a PUT, not yet answered."""
        kind, index_len, data_len = header
        started = time.perf_counter()
        stall_s = self._limits.stall_timeout_s
        deadline = Deadline(
            time.monotonic() + stall_s + (index_len + data_len) / MIN_FRAME_BYTES_PER_S, stall_s
        )
        if kind == PUT:
            if data_len > self.max_frame_bytes:
                raise ValueError(f"PUT frame of {data_len} bytes exceeds {self.max_frame_bytes}")
            if index_len > self.max_index_bytes:
                raise ValueError(
                    f"PUT index of {index_len} bytes exceeds {self.max_index_bytes} (the largest "
                    "of limits.max_blocks_per_request blocks)"
                )
            # The index counts in the budget while it is parsed (a frame of the largest payload
            # the vault takes holds all of it).
            held = min(index_len + data_len, self._inflight.capacity)
            if not self._inflight.acquire(held, stall_s, tenant.name):
                raise ValueError("no room for the frame's index and payloads in time")
            try:
                index = parse_message(vault_pb2.PutIndex, recv_bytes(sock, index_len, deadline))
                problem = request_problem(self._limits, len(index.lengths), 1)
                if problem is not None:
                    raise ValueError(problem)
                check_lengths(index.lengths, data_len)
                payloads = _recv_put_payloads(sock, index.lengths, deadline)
                answer = self._handler.put_blocks(index, payloads, tenant)
            finally:
                self._inflight.release(held, tenant.name)
            if unanswered is not None:
                self._reply(sock, unanswered)
            return _Unanswered(answer, deadline, data_len, started)
        if unanswered is not None:
            self._reply(sock, unanswered)
        if kind == PROMOTE and data_len == 0:
            request = parse_message(vault_pb2.PromoteRequest, recv_bytes(sock, index_len, deadline))
            promote_index, payloads = self._handler.promote_blocks(request, tenant)
            reply_bytes = sum(promote_index.lengths)
            send_frame(
                sock,
                PROMOTE_REPLY,
                promote_index,
                Deadline(deadline.at + reply_bytes / MIN_FRAME_BYTES_PER_S, stall_s),
                payloads,
            )
            self._handler.metrics.call(
                "promote", "bulk", reply_bytes, time.perf_counter() - started
            )
        else:
            raise ValueError(f"unexpected bulk frame kind {kind} with {data_len} data bytes")
        return None
