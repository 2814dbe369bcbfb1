"""The client's end of a vault's bulk data path (tierkv/vault/bulk.py the vault's, framing in
tierkv/wire/framing.py): Put and Promote payloads sent straight from their buffers and received
straight into the ones the caller keeps (one per run of payloads, or the ones `into` gives).

`BulkConnection(host, port, timeout_s, ...)` sends one request at a time (`put`, `promote`) and
raises `BulkError` on any failure, after which the connection is unusable (`BulkRefused`: the
vault said why it would not serve it).
"""

from __future__ import annotations

import itertools
import math
import select
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from tierkv.sizes import MIB
from tierkv.transfer import CLIENT_RUN_BYTES, RECEIVE_BUFFERS, Into, batched_by_size
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
    recv_scattered,
    send_frame,
)
from tierkv.wire.messages import split_payloads
from tierkv.wire.proofs import proof

RECEIVED_BYTES = 4 * MIB
"""A Promote hands on the payloads it received in groups of about this many bytes, so they are
checked while the next group is on the wire. Each group is one receive call, and so one release
of the GIL, which a thread busy in Python may keep for a switch interval (5 ms)."""
MAX_UNANSWERED_PUTS = 4
"""A client sends at most this many PUT frames ahead of the summaries it has read."""
MIN_PUT_BLOCKS_PER_S = 10_000
"""A client gives the vault its deadline plus the blocks it sends at this rate to store them
(small blocks cost the vault per block, not per byte: about 70k/s on an idle 2-core box)."""

T = TypeVar("T")


class BulkError(ConnectionError):
    """The bulk connection failed (peer gone, timeout, malformed frame); it is now closed.

    `timed_out`: the vault did not answer in time (a hung vault, not a refusal)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class BulkRefused(BulkError):
    """The vault refused the connection after its handshake and said why (a connection limit):
    a busy vault, not a failed one."""


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
        _, index_len, _ = parse_header(recv_bytes(self._sock, HEADER.size, clock), CHALLENGE)
        challenge = parse_message(vault_pb2.BulkChallenge, recv_bytes(self._sock, index_len, clock))
        answer = proof(token, challenge.nonce) if token and challenge.auth_required else b""
        send_frame(self._sock, AUTH, vault_pb2.BulkAuth(proof=answer), clock)
        _, index_len, _ = parse_header(recv_bytes(self._sock, HEADER.size, clock), WELCOME)
        welcome = parse_message(vault_pb2.BulkChallenge, recv_bytes(self._sock, index_len, clock))
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
                send_frame(self._sock, PUT, index, send_clock, payloads)
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
        _, index_len, data_len = parse_header(recv_bytes(self._sock, HEADER.size, clock), PUT_REPLY)
        if data_len:
            raise ValueError("a PUT_REPLY frame carries no payloads")
        return parse_message(vault_pb2.PutSummary, recv_bytes(self._sock, index_len, clock))

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
            send_frame(self._sock, PROMOTE, request, clock)
            # Asked while the vault looks the blocks up. A TLS socket cannot scatter (no
            # recvmsg_into): a receive per buffer would cost more than the copy it saves.
            plain = not isinstance(self._sock, ssl.SSLSocket)
            placement = into(range(len(request.keys)), request.parts) if into and plain else {}
            _, index_len, data_len = parse_header(
                recv_bytes(self._sock, HEADER.size, clock), PROMOTE_REPLY
            )
            index = parse_message(vault_pb2.PromoteIndex, recv_bytes(self._sock, index_len, clock))
            check_lengths(index.lengths, data_len)
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
                        recv_scattered(self._sock, flat, clock)
                        received(index, at, payloads)
                        at += len(payloads)
                    continue
                for run in batched_by_size(lengths, int, CLIENT_RUN_BYTES):
                    size = sum(run)
                    buf = RECEIVE_BUFFERS.take().data if size <= CLIENT_RUN_BYTES else None
                    buf = buf[:size] if buf is not None else empty_buffer(size)
                    offset = 0
                    for run_part in batched_by_size(run, int, RECEIVED_BYTES):
                        view = buf[offset : offset + sum(run_part)]
                        recv_into(self._sock, view, clock)
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
