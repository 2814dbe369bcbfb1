"""The bulk data path's framing, what both ends of it share: frame kinds, headers, deadlines,
and sending and receiving frames and payloads straight from and into their buffers.

gRPC's HTTP/2 framing and its per-message copies cap a Python stream at about a tenth of memcpy
on a small machine; a plain socket reaches about a quarter. So Put and Promote payloads also
travel over a plain TCP connection beside gRPC: the sender writes them straight from their
buffers and the receiver reads them straight into the buffers it keeps. The frame format is
documented at the top of proto/tierkv/v1/vault.proto. The vault's end is tierkv/vault/bulk.py,
the client's tierkv/backends/vault_bulk.py.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import socket
import ssl
import struct
import time
from collections.abc import Iterator, Sequence
from typing import TypeVar

import numpy as np
from google.protobuf.message import DecodeError, Message

from tierkv.sizes import MIB

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
SEND_BUFFERS = 512
"""Buffers per sendmsg call (the kernel takes at most IOV_MAX, 1024 on Linux)."""
RECV_BUFFERS = 256
"""Buffers per recvmsg_into call (the kernel takes at most IOV_MAX)."""

Payload = bytes | memoryview
MessageT = TypeVar("MessageT", bound=Message)


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
        is up (see timed_out)."""
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
def timed_out() -> Iterator[None]:
    """A kernel timeout (BlockingIOError on a blocking socket, see Deadline.arm) as the
    TimeoutError of a Python one."""
    try:
        yield
    except BlockingIOError:
        raise TimeoutError("timed out") from None


def send_frame(
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
        with timed_out():
            sent = sock.sendmsg(buffers[first : first + SEND_BUFFERS])
        while first < len(buffers) and sent >= len(buffers[first]):
            sent -= len(buffers[first])
            first += 1
        if sent:
            buffers[first] = buffers[first][sent:]


def recv_into(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
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
        with timed_out():
            received = sock.recv_into(view[filled:], 0, flags)
        if received == 0:
            raise ConnectionError("the peer closed the connection mid-frame")
        filled += received


def recv_scattered(sock: socket.socket, buffers: list[memoryview], deadline: Deadline) -> None:
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
        with timed_out():
            received = sock.recvmsg_into(window, 0, socket.MSG_WAITALL)[0]
        if received == 0:
            raise ConnectionError("the peer closed the connection mid-frame")
        filled += received
        first = bisect.bisect_right(ends, filled, first)


def recv_bytes(sock: socket.socket, size: int, deadline: Deadline) -> bytes:
    buf = bytearray(size)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def parse_header(raw: bytes, expected_kind: int | None = None) -> tuple[int, int, int]:
    """(kind, index length, data length) of a frame header; ValueError when it is malformed."""
    magic, kind, index_len, data_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ValueError(f"not a tierkv bulk frame (magic {magic!r})")
    if expected_kind is not None and kind != expected_kind:
        raise ValueError(f"expected a frame of kind {expected_kind}, got {kind}")
    if index_len > MAX_INDEX_BYTES:
        raise ValueError(f"frame index of {index_len} bytes exceeds {MAX_INDEX_BYTES}")
    return kind, index_len, data_len


def parse_message(message_type: type[MessageT], raw: bytes) -> MessageT:
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        raise ValueError(f"cannot parse {message_type.__name__}: {exc}") from None


def check_lengths(lengths: Sequence[int], data_len: int) -> None:
    if sum(lengths) != data_len:
        raise ValueError(f"index lengths sum to {sum(lengths)} bytes, frame carries {data_len}")


def empty_buffer(size: int) -> memoryview:
    """Writable uninitialised memory (no zero-filling pass, unlike bytearray)."""
    return np.empty(size, dtype=np.uint8).data
