"""The vault's bulk data path: Put and Promote frames over a plain TCP connection beside gRPC.

gRPC's HTTP/2 framing and its per-message copies cap a Python stream at about a tenth of memcpy
on a small machine; a plain socket reaches about a quarter. So Put and Promote payloads also
travel here: the sender writes them straight from their buffers and the receiver reads them
straight into the buffers it keeps (the vault: one per stored payload; the client: one per run
of payloads). The frame format is documented at the top of proto/tierkv/v1/vault.proto.

Vault side: `BulkServer(host, port, handler, ...)` listens and answers frames on a thread per
connection, calling `handler.put_blocks` / `handler.promote_blocks`; `stop()` closes everything.
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
Client side: `BulkConnection(host, port, timeout_s, ...)` sends one request at a time (`put`,
`promote`) and raises `BulkError` on any failure, after which the connection is unusable
(`BulkRefused`: the vault said why it would not serve it).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import os
import select
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol, TypeVar

import numpy as np
from google.protobuf.message import DecodeError, Message

from tierkv.config import LimitsConfig
from tierkv.sizes import KIB, MIB
from tierkv.transfer import CLIENT_RUN_BYTES, RECEIVE_BUFFERS, Into, batched_by_size
from tierkv.vault._pb import vault_pb2
from tierkv.vault.auth import NONCE_BYTES, OPEN, Access, Tenant, proof
from tierkv.vault.limits import ByteBudget, ConnectionSlots, request_problem
from tierkv.vault.metrics import VaultMetrics
from tierkv.vault.wire import split_payloads

MAGIC = b"TKVB"
HEADER = struct.Struct("<4sBIQ")
"""magic, kind, index length, data length"""
PUT, PUT_REPLY, PROMOTE, PROMOTE_REPLY, CHALLENGE, AUTH, WELCOME = 1, 2, 3, 4, 5, 6, 7
TLS_SEND_BYTES = 1 * MIB
"""A TLS socket has no sendmsg: payloads are sent in slices of this, the deadline checked
between them."""
MAX_INDEX_BYTES = 16 * MIB
"""Larger index lengths are protocol errors (an index holds about 40 bytes per block, and a
request at most limits.max_blocks_per_request blocks)."""
SMALL_RUN_BYTES = 256 * KIB
"""The vault receives payloads smaller than this in runs that it splits with one copy, which
costs less than a system call per payload."""
SEND_BUFFERS = 512
"""Buffers per sendmsg call (the kernel takes at most IOV_MAX, 1024 on Linux)."""
RECV_BUFFERS = 256
"""Buffers per recvmsg_into call (the kernel takes at most IOV_MAX)."""
RECEIVED_BYTES = 4 * MIB
"""A Promote hands on the payloads it received in groups of about this many bytes, so they are
checked while the next group is on the wire. Each group is one receive call, and so one release
of the GIL, which a thread busy in Python may keep for a switch interval (5 ms)."""
MAX_AUTH_BYTES = 1024
"""Larger AUTH frames are protocol errors (a proof is 32 bytes)."""
MIN_FRAME_BYTES_PER_S = 1e6
"""The vault gives a frame limits.stall_timeout_s plus its bytes at this rate to arrive or leave
(a peer trickling bytes is dropped then, however steady the trickle)."""
MAX_UNANSWERED_PUTS = 4
"""A client sends at most this many PUT frames ahead of the summaries it has read."""
MIN_PUT_BLOCKS_PER_S = 10_000
"""A client gives the vault its deadline plus the blocks it sends at this rate to store them
(small blocks cost the vault per block, not per byte: about 70k/s on an idle 2-core box)."""


class BulkError(ConnectionError):
    """The bulk connection failed (peer gone, timeout, malformed frame); it is now closed.

    `timed_out`: the vault did not answer in time (a hung vault, not a refusal)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class BulkRefused(BulkError):
    """The vault refused the connection after its handshake and said why (a connection limit):
    a busy vault, not a failed one."""


Payload = bytes | memoryview
T = TypeVar("T")
MessageT = TypeVar("MessageT", bound=Message)


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


# ---- both ends ---------------------------------------------------------------------------------


class Deadline:
    """An absolute deadline (time.monotonic()) for a whole exchange, with `stall_s` bounding
    each wait for the peer: `arm(sock)` before every send or receive."""

    def __init__(self, at: float, stall_s: float) -> None:
        self.at = at
        self.stall_s = stall_s

    def arm(self, sock: socket.socket) -> None:
        """Bound the socket's next operation by the stall time and the deadline; TimeoutError
        once the deadline has passed.

        A plain socket is made blocking, with the kernel's send and receive timeouts set, so
        one system call (one release of the GIL) receives a whole buffer (MSG_WAITALL) or
        sends a whole frame. Python's own timeouts need a poll and a call per piece that has
        arrived, and each time the GIL is given back a thread busy in Python (an engine's) may
        keep it for a switch interval (5 ms). Those calls raise BlockingIOError when the time
        is up (see _timed_out)."""
        remaining = self.at - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the deadline passed")
        wait = min(self.stall_s, remaining)
        if isinstance(sock, ssl.SSLSocket):
            sock.settimeout(wait)
            return
        sock.settimeout(None)
        seconds = int(wait)
        timeval = struct.pack("@ll", seconds, max(1, int((wait - seconds) * 1e6)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)

    def rearm(self, sock: socket.socket) -> None:
        """`arm` again before another operation of one receive, where needed: a TLS socket's
        timeout (a system call to set) armed with the stall time still bounds the next
        operation while the deadline is further away than that."""
        if not isinstance(sock, ssl.SSLSocket) or self.at - time.monotonic() < self.stall_s:
            self.arm(sock)


@contextlib.contextmanager
def _timed_out() -> Iterator[None]:
    """A kernel timeout (BlockingIOError on a blocking socket, see Deadline.arm) as the
    TimeoutError of a Python one."""
    try:
        yield
    except BlockingIOError:
        raise TimeoutError("timed out") from None


def _send_frame(
    sock: socket.socket,
    kind: int,
    index: Message,
    deadline: Deadline,
    payloads: Sequence[Payload] = (),
) -> None:
    """Header, index and payloads, the payloads sent from where they lie (scatter-gather)."""
    index_bytes = index.SerializeToString()
    data_len = sum(len(p) for p in payloads)
    head = HEADER.pack(MAGIC, kind, len(index_bytes), data_len) + index_bytes
    buffers = [memoryview(head), *(memoryview(p) for p in payloads if len(p))]
    if isinstance(sock, ssl.SSLSocket):
        for buf in buffers:
            for start in range(0, len(buf), TLS_SEND_BYTES):
                deadline.arm(sock)
                sock.sendall(buf[start : start + TLS_SEND_BYTES])
        return
    first = 0  # buffers[first:] are still to send
    while first < len(buffers):
        deadline.arm(sock)
        with _timed_out():
            sent = sock.sendmsg(buffers[first : first + SEND_BUFFERS])
        while first < len(buffers) and sent >= len(buffers[first]):
            sent -= len(buffers[first])
            first += 1
        if sent:
            buffers[first] = buffers[first][sent:]


def _recv_into(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    """Fill `view` from the socket by the deadline; ConnectionError when the peer closes first.

    A TLS socket returns one 16 KiB record per call; its timeout is set again only when the
    deadline comes nearer than the stall time (setting it costs a system call, a third of the
    calls per record)."""
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    filled = 0
    while filled < len(view):
        if filled:
            deadline.rearm(sock)
        else:
            deadline.arm(sock)
        with _timed_out():
            received = sock.recv_into(view[filled:], 0, flags)
        if received == 0:
            raise ConnectionError("the peer closed the connection mid-frame")
        filled += received


def _recv_scattered(sock: socket.socket, buffers: list[memoryview], deadline: Deadline) -> None:
    """Fill `buffers` in order from the (plain TCP) socket by the deadline (scatter-gather);
    ConnectionError when the peer closes first."""
    ends = list(itertools.accumulate(map(len, buffers)))  # bytes up to the end of each
    filled = first = 0  # buffers[first:] are still to fill, buffers[first] from filled
    while first < len(buffers):
        window = buffers[first : first + RECV_BUFFERS]
        start = ends[first] - len(window[0])
        if filled > start:
            window[0] = window[0][filled - start :]
        deadline.arm(sock)
        with _timed_out():
            received = sock.recvmsg_into(window, 0, socket.MSG_WAITALL)[0]
        if received == 0:
            raise ConnectionError("the peer closed the connection mid-frame")
        filled += received
        first = bisect.bisect_right(ends, filled, first)


def _recv_bytes(sock: socket.socket, size: int, deadline: Deadline) -> bytes:
    buf = bytearray(size)
    _recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def _parse_header(raw: bytes, expected_kind: int | None = None) -> tuple[int, int, int]:
    """(kind, index length, data length) of a frame header; ValueError when it is malformed."""
    magic, kind, index_len, data_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ValueError(f"not a tierkv bulk frame (magic {magic!r})")
    if expected_kind is not None and kind != expected_kind:
        raise ValueError(f"expected a frame of kind {expected_kind}, got {kind}")
    if index_len > MAX_INDEX_BYTES:
        raise ValueError(f"frame index of {index_len} bytes exceeds {MAX_INDEX_BYTES}")
    return kind, index_len, data_len


def _parse(message_type: type[MessageT], raw: bytes) -> MessageT:
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        raise ValueError(f"cannot parse {message_type.__name__}: {exc}") from None


def _check_lengths(lengths: Sequence[int], data_len: int) -> None:
    if sum(lengths) != data_len:
        raise ValueError(f"index lengths sum to {sum(lengths)} bytes, frame carries {data_len}")


def _empty_buffer(size: int) -> memoryview:
    """Writable uninitialised memory (no zero-filling pass, unlike bytearray)."""
    return np.empty(size, dtype=np.uint8).data


# ---- vault side --------------------------------------------------------------------------------


def _recv_put_payloads(
    sock: socket.socket, lengths: Sequence[int], deadline: Deadline
) -> list[Payload]:
    """The payloads of a PUT frame, each in memory of its own (evicting one frees it)."""
    payloads: list[Payload] = []
    for run in batched_by_size(list(lengths), int, SMALL_RUN_BYTES):
        buf = _empty_buffer(sum(run))
        _recv_into(sock, buf, deadline)
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
        self.max_frame_bytes = min(limits.max_inflight_bytes, max_bytes or sys.maxsize)
        """Payload bytes of the largest PUT frame received (Hello tells clients)."""
        self._inflight = inflight
        self._slots = ConnectionSlots(limits.max_connections, limits.max_connections_per_client)
        self._tenant_slots = ConnectionSlots(
            limits.max_connections, limits.max_connections_per_tenant
        )
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
                _recv_into(sock, memoryview(head)[1:], stall)
                unanswered = self._answer_frame(
                    sock, _parse_header(bytes(head)), tenant, unanswered
                )
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
        _send_frame(sock, CHALLENGE, challenge, clock)
        _, index_len, data_len = _parse_header(_recv_bytes(sock, HEADER.size, clock), AUTH)
        if data_len or index_len > MAX_AUTH_BYTES:
            raise ValueError("malformed AUTH frame")
        answer = _parse(vault_pb2.BulkAuth, _recv_bytes(sock, index_len, clock)).proof
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
            _send_frame(sock, WELCOME, vault_pb2.BulkChallenge(refused=refusal), clock)
            raise ValueError(refusal)
        try:
            _send_frame(sock, WELCOME, vault_pb2.BulkChallenge(), clock)
        except BaseException:
            if tenant.prefix:
                self._tenant_slots.give_back(tenant.name)
            raise
        return tenant

    def _reply(self, sock: socket.socket, put: _Unanswered) -> None:
        """Send a stored PUT frame's summary once its blocks are durable."""
        _send_frame(sock, PUT_REPLY, put.answer(), put.deadline)
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
            index = _parse(vault_pb2.PutIndex, _recv_bytes(sock, index_len, deadline))
            problem = request_problem(self._limits, len(index.lengths), 1)
            if problem is not None:
                raise ValueError(problem)
            _check_lengths(index.lengths, data_len)
            if not self._inflight.acquire(data_len, stall_s):
                raise ValueError("no room for the frame's payloads in time")
            try:
                payloads = _recv_put_payloads(sock, index.lengths, deadline)
                answer = self._handler.put_blocks(index, payloads, tenant)
            finally:
                self._inflight.release(data_len)
            if unanswered is not None:
                self._reply(sock, unanswered)
            return _Unanswered(answer, deadline, data_len, started)
        if unanswered is not None:
            self._reply(sock, unanswered)
        if kind == PROMOTE and data_len == 0:
            request = _parse(vault_pb2.PromoteRequest, _recv_bytes(sock, index_len, deadline))
            promote_index, payloads = self._handler.promote_blocks(request, tenant)
            reply_bytes = sum(promote_index.lengths)
            _send_frame(
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


# ---- client side -------------------------------------------------------------------------------


def _second(pair: tuple[object, int]) -> int:
    return pair[1]


def _placed(
    index: vault_pb2.PromoteIndex, placement: dict[tuple[int, int], list[memoryview]]
) -> list[list[memoryview] | None]:
    """Per payload of a PROMOTE_REPLY, the buffers `placement` gives for its block when they
    hold exactly its length; None: a run buffer's (for every payload of a malformed index, and
    for a block sent again: a vault must not overwrite a payload already verified in place)."""
    key_indices, parts, lengths = index.key_indices, index.parts, index.lengths
    if not placement or not len(key_indices) == len(parts) == len(lengths):
        return [None] * len(lengths)
    placement = dict(placement)
    placed: list[list[memoryview] | None] = []
    for key_index, part, length in zip(key_indices, parts, lengths, strict=True):
        bufs = placement.pop((key_index, part), None)
        placed.append(bufs if bufs is not None and sum(map(len, bufs)) == length else None)
    return placed


class BulkConnection:
    """One client connection to a vault's bulk port; one call at a time (not thread-safe).

    Every call takes an absolute `deadline` (time.monotonic()) that bounds every send and
    receive of it, however slowly the vault trickles; `timeout_s` also bounds each wait for the
    vault, so a hung vault fails the call after that long without progress.
    """

    def __init__(
        self,
        host: str,
        port: int,
        timeout_s: float,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                self._sock = tls.wrap_socket(self._sock, server_hostname=host)
        except (OSError, ValueError) as exc:
            raise BulkError(f"cannot connect to the bulk port {host}:{port}: {exc}") from None
        self._guarded(lambda: self._authenticate(token))

    def _authenticate(self, token: str | None) -> None:
        """Answer the vault's challenge; a vault that refuses closes the connection (BulkRefused
        when it said why)."""
        clock = Deadline(time.monotonic() + self.timeout_s, self.timeout_s)
        _, index_len, _ = _parse_header(_recv_bytes(self._sock, HEADER.size, clock), CHALLENGE)
        challenge = _parse(vault_pb2.BulkChallenge, _recv_bytes(self._sock, index_len, clock))
        answer = proof(token, challenge.nonce) if token and challenge.auth_required else b""
        _send_frame(self._sock, AUTH, vault_pb2.BulkAuth(proof=answer), clock)
        _, index_len, _ = _parse_header(_recv_bytes(self._sock, HEADER.size, clock), WELCOME)
        welcome = _parse(vault_pb2.BulkChallenge, _recv_bytes(self._sock, index_len, clock))
        if welcome.refused:
            raise BulkRefused(f"the vault refused the bulk connection: {welcome.refused}")

    def put(
        self, frames: Iterable[tuple[vault_pb2.PutIndex, Sequence[Payload]]], deadline: float
    ) -> list[vault_pb2.PutSummary]:
        """Send PUT frames and return the vault's summaries, one per frame.

        The vault stores frame k while frame k+1 is still being prepared (`frames` may build
        each index lazily) and sent, so both ends work at once; at most MAX_UNANSWERED_PUTS
        frames await their summary, so unread summaries never fill the socket buffers.
        """
        send_clock = Deadline(deadline, math.inf)  # the vault may be storing the frame before

        def call() -> list[vault_pb2.PutSummary]:
            blocks: list[int] = []  # of each frame sent
            summaries: list[vault_pb2.PutSummary] = []
            for index, payloads in frames:
                _send_frame(self._sock, PUT, index, send_clock, payloads)
                blocks.append(len(index.keys))
                while len(blocks) - len(summaries) >= MAX_UNANSWERED_PUTS:
                    summaries.append(self._put_summary(deadline, blocks[len(summaries) :]))
            while len(summaries) < len(blocks):
                summaries.append(self._put_summary(deadline, blocks[len(summaries) :]))
            return summaries

        return self._guarded(call)

    def _put_summary(self, deadline: float, unanswered: list[int]) -> vault_pb2.PutSummary:
        """The summary of the first of the frames sent and not answered yet (`unanswered`: their
        block counts). The vault stores the next frame, when it is already arriving, before it
        answers one, so it may take timeout_s plus the storing time (at MIN_PUT_BLOCKS_PER_S) of
        this frame's blocks and the next one's."""
        blocks = sum(unanswered[:2])
        clock = Deadline(deadline, self.timeout_s + blocks / MIN_PUT_BLOCKS_PER_S)
        _, index_len, data_len = _parse_header(
            _recv_bytes(self._sock, HEADER.size, clock), PUT_REPLY
        )
        if data_len:
            raise ValueError("a PUT_REPLY frame carries no payloads")
        return _parse(vault_pb2.PutSummary, _recv_bytes(self._sock, index_len, clock))

    def promote(
        self,
        request: vault_pb2.PromoteRequest,
        deadline: float,
        received: Callable[[vault_pb2.PromoteIndex, int, list[list[memoryview]]], None],
        into: Into | None = None,
    ) -> vault_pb2.PromoteIndex:
        """Receive every block the vault has; returns the reply's index. Each group of about
        RECEIVED_BYTES of payloads is handed to `received(index, first, payloads)` as soon as
        it has arrived (payloads[i] is the one at position first + i of the index), each as
        the buffers it lies in: the ones `into(key indices, parts)` (asked for every block of
        the request, unless over TLS) gave for it, received straight into them with no copy of
        ours, else one view of a run buffer. The caller verifies them: they may hold anything
        the vault sent."""
        clock = Deadline(deadline, self.timeout_s)

        def call() -> vault_pb2.PromoteIndex:
            _send_frame(self._sock, PROMOTE, request, clock)
            # Asked while the vault looks the blocks up. A TLS socket cannot scatter (no
            # recvmsg_into): a receive per buffer would cost more than the copy it saves.
            plain = not isinstance(self._sock, ssl.SSLSocket)
            placement = into(range(len(request.keys)), request.parts) if into and plain else {}
            _, index_len, data_len = _parse_header(
                _recv_bytes(self._sock, HEADER.size, clock), PROMOTE_REPLY
            )
            index = _parse(vault_pb2.PromoteIndex, _recv_bytes(self._sock, index_len, clock))
            _check_lengths(index.lengths, data_len)
            placed = _placed(index, placement)
            at = 0
            for own, group in itertools.groupby(placed, key=lambda bufs: bufs is None):
                stretch = list(group)
                lengths = list(index.lengths[at : at + len(stretch)])
                if not own:  # payloads `into` placed, received with scatter-gather
                    pairs = list(zip(stretch, lengths, strict=True))
                    for some in batched_by_size(pairs, _second, RECEIVED_BYTES):
                        payloads = [bufs or [] for bufs, _ in some]
                        flat = [buf for bufs in payloads for buf in bufs]
                        _recv_scattered(self._sock, flat, clock)
                        received(index, at, payloads)
                        at += len(payloads)
                    continue
                for run in batched_by_size(lengths, int, CLIENT_RUN_BYTES):
                    size = sum(run)
                    buf = RECEIVE_BUFFERS.take().data if size <= CLIENT_RUN_BYTES else None
                    buf = buf[:size] if buf is not None else _empty_buffer(size)
                    offset = 0
                    for run_part in batched_by_size(run, int, RECEIVED_BYTES):
                        view = buf[offset : offset + sum(run_part)]
                        _recv_into(self._sock, view, clock)
                        offset += len(view)
                        views = split_payloads(view.toreadonly(), run_part)
                        received(index, at, [[payload] for payload in views])
                        at += len(views)
            return index

        return self._guarded(call)

    def is_open(self) -> bool:
        """False when the vault has closed this (idle) connection, e.g. by restarting."""
        if isinstance(self._sock, ssl.SSLSocket):  # no MSG_PEEK: anything to read means closed
            try:
                readable, _, _ = select.select([self._sock], [], [], 0)
            except (OSError, ValueError):
                return False
            return not readable and not self._sock.pending()
        self._sock.settimeout(0.0)  # non-blocking (a timeout would make recv wait)
        try:
            self._sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True  # nothing to read: connected and in step
        except OSError:
            pass
        return False  # closed by the vault, or unrequested bytes (out of step)

    def close(self) -> None:
        self._sock.close()

    def _guarded(self, call: Callable[[], T]) -> T:
        """Run `call`; on any failure close the connection (its framing is lost) and raise.

        A reply too large to allocate (MemoryError) is a failure like any other."""
        try:
            return call()
        except BulkRefused:
            self.close()
            raise
        except (OSError, ValueError, MemoryError) as exc:
            self.close()
            timed_out = isinstance(exc, TimeoutError)
            raise BulkError(f"bulk call failed: {exc!r}", timed_out) from None
