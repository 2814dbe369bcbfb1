"""The bulk data path (plain TCP beside gRPC): used by default, falls back to gRPC, survives
restarts and garbage, and never returns or stores a payload that did not arrive intact."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import flip_byte, key

from tests.tls_certs import make_certs
from tierkv.backends.vault import VaultClient
from tierkv.config import LimitsConfig
from tierkv.transfer import ReceiveBuffers
from tierkv.vault.memory import HUGE_PAGE_TUNABLE, with_huge_pages
from tierkv.vault.server import VaultBindError, serve
from tierkv.vault.store import entry_bytes
from tierkv.wire._pb import vault_pb2, vault_pb2_grpc
from tierkv.wire.framing import (
    AUTH,
    CHALLENGE,
    HEADER,
    MAGIC,
    PUT,
    RECV_BUFFERS,
    WELCOME,
    Deadline,
    recv_into,
    recv_scattered,
)

NS = b"b" * 16


def payload(i: int, size: int) -> bytes:
    return bytes([i % 251]) * size


def test_put_and_promote_travel_the_bulk_path(vault: Any) -> None:
    sizes = [1, 2, 300, 64 * 1024, 300 * 1024, 9 * 1024 * 1024]  # runs and lone payloads
    with VaultClient(vault.address, max_pending_bytes=64 * 1024 * 1024) as client:
        for i, size in enumerate(sizes):
            client.put(NS, key(i), i % 2, payload(i, size))
        assert client.flush(timeout=30)
        assert client.transport == "bulk"
        assert vault.server.bulk_port > 0
        found = client.promote(NS, [key(i) for i in range(len(sizes))], [0, 1])
        assert client.transport == "bulk"
        assert {k: bytes(v) for k, v in found.items()} == {
            (i, i % 2): payload(i, size) for i, size in enumerate(sizes)
        }
        assert vault.store.stats().bytes_used == sum(
            entry_bytes(NS, key(i), size) for i, size in enumerate(sizes)
        )


def test_a_promote_receives_payloads_into_the_buffers_it_is_given(vault: Any) -> None:
    """`into` places payloads (in pieces) where the caller wants them: each is returned as its
    first buffer, one whose checksum then fails is absent; the others land in run buffers."""
    sizes = [100, 7, 300, 64 * 1024, 50]
    with VaultClient(vault.address) as client:
        for i, size in enumerate(sizes):
            client.put(NS, key(i), 0, payload(i, size))
        assert client.flush(timeout=30)
        flip_byte(vault.store, (NS, key(3), 0), 0)
        pieces = {i: [bytearray(3), bytearray(size - 3)] for i, size in enumerate(sizes)}
        pieces[1].append(bytearray(1))  # one byte too many: not used
        del pieces[2]  # not placed

        def into(indices, parts):
            assert (list(indices), list(parts)) == (list(range(len(sizes))), [0])
            return {(i, 0): [memoryview(b) for b in pieces[i]] for i in indices if i in pieces}

        found = client.promote(NS, [key(i) for i in range(len(sizes))], [0], into)
        assert client.transport == "bulk"
        assert sorted(found) == [(0, 0), (1, 0), (2, 0), (4, 0)]  # 3: its checksum failed
        assert client.checksum_failures == 1
        for i in (0, 4):
            assert found[(i, 0)].obj is pieces[i][0]
            assert b"".join(pieces[i]) == payload(i, sizes[i])
        for i in (1, 2):  # in a run buffer
            assert bytes(found[(i, 0)]) == payload(i, sizes[i])


@contextlib.contextmanager
def trickling(
    sender: socket.socket,
    receiver: socket.socket,
    data: bytes,
    piece_bytes: Callable[[], int],
    pause_s: float,
) -> Iterator[None]:
    """While inside, a thread sends `data` from `sender` in pieces of piece_bytes() bytes, a
    pause after each; both sockets are closed on the way out."""

    def send() -> None:
        at = 0
        while at < len(data):
            piece = piece_bytes()
            sender.sendall(data[at : at + piece])
            at += piece
            time.sleep(pause_s)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        yield
    finally:
        thread.join()
        sender.close()
        receiver.close()


def test_a_scattered_receive_fills_every_buffer_however_the_bytes_arrive() -> None:
    """More buffers than one recvmsg_into takes, empty ones among them, and bytes that arrive
    in pieces cutting buffers anywhere: each buffer gets exactly its stretch of the stream."""
    rng = random.Random(0)
    lengths = [rng.choice([0, 1, 3, 700, 4096, 20_000]) for _ in range(3 * RECV_BUFFERS)]
    data = rng.randbytes(sum(lengths))
    buffers = [memoryview(bytearray(length)) for length in lengths]
    received = list(buffers)
    sender, receiver = socket.socketpair()

    def pieces() -> int:
        return rng.choice([1, 7, 4093, 65_536, 300_000])

    with trickling(sender, receiver, data, pieces, 0.0005):
        recv_scattered(receiver, buffers, Deadline(time.monotonic() + 30, 30))
    assert b"".join(received) == data


class CountingSocket(socket.socket):
    """A socket that counts its recv_into calls."""

    calls = 0

    def recv_into(self, *args: Any) -> int:
        CountingSocket.calls += 1
        return super().recv_into(*args)


def test_a_receive_asks_the_kernel_once_however_the_bytes_trickle_in() -> None:
    """Each call gives the GIL back, and a thread busy in Python may then keep it for a switch
    interval (5 ms): one call per buffer, not one per piece that has arrived."""
    data = random.Random(1).randbytes(1 << 20)
    sender, plain = socket.socketpair()
    receiver = CountingSocket(fileno=plain.detach())
    view = memoryview(bytearray(len(data)))
    with trickling(sender, receiver, data, lambda: 1 << 16, 0.002):
        recv_into(receiver, view, Deadline(time.monotonic() + 30, 30))
    assert view == data
    assert CountingSocket.calls == 1


@pytest.mark.parametrize("deadline_s, stall_s", [(0.3, 30), (30, 0.3)], ids=["deadline", "stall"])
def test_a_silent_peer_times_out_a_receive_by_its_deadline_or_stall_time(
    deadline_s: float, stall_s: float
) -> None:
    sender, receiver = socket.socketpair()
    sender.sendall(b"x" * 1000)  # a part of the buffer arrives, then nothing
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            recv_into(
                receiver, memoryview(bytearray(4096)), Deadline(started + deadline_s, stall_s)
            )
    finally:
        sender.close()
        receiver.close()
    assert 0.25 < time.monotonic() - started < 5


@pytest.fixture
def tls_pair(tmp_path: Path) -> Iterator[tuple[ssl.SSLSocket, ssl.SSLSocket]]:
    """(sender, receiver): the two ends of a TLS connection over a socket pair."""
    certs = make_certs(tmp_path / "certs")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certs.server_cert, certs.server_key)
    client = ssl.create_default_context(cafile=str(certs.ca))
    one, other = socket.socketpair()
    with futures.ThreadPoolExecutor(1) as pool:
        sender = pool.submit(server.wrap_socket, one, server_side=True)
        receiver = client.wrap_socket(other, server_hostname="127.0.0.1")
        pair = sender.result(), receiver
    yield pair
    for end in pair:
        end.close()


@pytest.mark.parametrize("deadline_s, stall_s", [(0.3, 30), (30, 0.3)], ids=["deadline", "stall"])
def test_a_silent_tls_peer_times_out_a_receive_by_its_deadline_or_stall_time(
    tls_pair: tuple[ssl.SSLSocket, ssl.SSLSocket], deadline_s: float, stall_s: float
) -> None:
    sender, receiver = tls_pair
    sender.sendall(b"x" * 40_000)  # records of a part of the buffer arrive, then nothing
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        recv_into(receiver, memoryview(bytearray(1 << 20)), Deadline(started + deadline_s, stall_s))
    assert 0.25 < time.monotonic() - started < 5


@pytest.mark.parametrize("deadline_s, once", [(60, True), (20, False)], ids=["far", "near"])
def test_a_tls_receive_sets_its_timeout_again_only_when_the_deadline_is_near(
    tls_pair: tuple[ssl.SSLSocket, ssl.SSLSocket],
    monkeypatch: pytest.MonkeyPatch,
    deadline_s: float,
    once: bool,
) -> None:
    """Setting a timeout is a system call; one 16 KiB record arrives per receive call. While
    the deadline is further than the stall time (30 s), the timeout set first bounds each."""
    sender, receiver = tls_pair
    data = random.Random(2).randbytes(1 << 20)
    calls: list[float | None] = []
    settimeout = receiver.settimeout
    monkeypatch.setattr(receiver, "settimeout", lambda s: (calls.append(s), settimeout(s)))
    view = memoryview(bytearray(len(data)))
    with futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(sender.sendall, data)
        recv_into(receiver, view, Deadline(time.monotonic() + deadline_s, 30))
        sent.result()
    assert view == data
    if once:
        assert len(calls) == 1
    else:  # nearer than the stall time: set before each of the 64 records or more
        assert len(calls) >= 64


def test_a_block_sent_twice_is_placed_once() -> None:
    """A vault that sends a block again must not overwrite the copy already verified in place:
    the second goes to a run buffer (and is checked on its own)."""
    from tierkv.backends.vault_bulk import _placed

    index = vault_pb2.PromoteIndex(key_indices=[0, 1, 0], parts=[0, 0, 0], lengths=[4, 4, 4])
    given = {(0, 0): [memoryview(bytearray(4))], (1, 0): [memoryview(bytearray(2))]}
    assert _placed(index, given) == [given[(0, 0)], None, None]  # 1: buffers of 2 bytes, not 4
    assert len(given) == 2  # the caller's placement is left as it was


def test_a_vault_without_bulk_path_is_served_over_grpc() -> None:
    server = serve("127.0.0.1:0", 0, bulk_port=None)
    try:
        with VaultClient(server.address) as client:
            client.put(NS, key(1), 0, b"over grpc")
            assert client.flush(timeout=10)
            assert client.promote(NS, [key(1)], [0])[(0, 0)] == b"over grpc"
            assert client.transport == "grpc"
    finally:
        server.stop(grace=0)


def test_a_restarted_vault_is_reached_again_without_a_failed_call(free_port: int) -> None:
    address = f"127.0.0.1:{free_port}"
    server = serve(address, 0)
    client = VaultClient(address)
    try:
        client.put(NS, key(1), 0, b"first life")
        assert client.flush(timeout=10)  # leaves an idle bulk connection to the old vault
        server.stop(grace=0)
        server = serve(address, 0)  # a new bulk port
        client.put(NS, key(2), 0, b"second life")
        assert client.flush(timeout=10)
        assert client.promote(NS, [key(1), key(2)], [0]) == {(1, 0): b"second life"}
        assert client.failed_calls == 0 and client.transport == "bulk"
    finally:
        client.close()
        server.stop(grace=0)


def _bulk_socket(port: int) -> socket.socket:
    """A raw connection to the bulk port, past the vault's challenge (a vault without tokens)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    _, kind, index_len, _ = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
    assert kind == CHALLENGE and sock.recv(index_len, socket.MSG_WAITALL) is not None
    sock.sendall(HEADER.pack(MAGIC, AUTH, 0, 0))
    _, kind, index_len, _ = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
    assert kind == WELCOME and (index_len == 0 or sock.recv(index_len, socket.MSG_WAITALL))
    return sock


def _closed_by_vault(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "frame",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 64,  # not a tierkv frame
        HEADER.pack(MAGIC, 99, 0, 0),  # unknown kind
        HEADER.pack(MAGIC, PUT, 3, 0) + b"\xff\xff\xff",  # index that does not parse
    ],
    ids=["http", "unknown-kind", "bad-index"],
)
def test_garbage_on_the_bulk_port_closes_that_connection_only(vault: Any, frame: bytes) -> None:
    with _bulk_socket(vault.server.bulk_port) as sock:
        sock.sendall(frame)
        assert _closed_by_vault(sock)
    with VaultClient(vault.address) as client:
        client.put(NS, key(1), 0, b"still serving")
        assert client.flush(timeout=10)
        assert client.promote(NS, [key(1)], [0]) == {(0, 0): b"still serving"}


def test_a_frame_whose_index_disagrees_with_its_data_stores_nothing(vault: Any) -> None:
    index = vault_pb2.PutIndex(namespace=NS, keys=[key(1)], parts=[0], lengths=[10], checksums=[0])
    raw = index.SerializeToString()
    with _bulk_socket(vault.server.bulk_port) as sock:
        sock.sendall(HEADER.pack(MAGIC, PUT, len(raw), 4) + raw + b"abcd")
        assert _closed_by_vault(sock)
    assert vault.store.stats().entries == 0


def test_a_corrupted_payload_on_the_bulk_path_is_rejected(vault: Any) -> None:
    good = b"x" * 100
    index = vault_pb2.PutIndex(
        namespace=NS, keys=[key(1)], parts=[0], lengths=[len(good)], checksums=[12345]
    )
    raw = index.SerializeToString()
    with _bulk_socket(vault.server.bulk_port) as sock:
        sock.sendall(HEADER.pack(MAGIC, PUT, len(raw), len(good)) + raw + good)
        _, _, index_len, data_len = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
        summary = vault_pb2.PutSummary.FromString(sock.recv(index_len, socket.MSG_WAITALL))
    assert (summary.stored, summary.rejected, data_len) == (0, 1, 0)
    assert "checksum" in summary.rejections[0].reason
    assert vault.store.stats().entries == 0


def test_a_taken_bulk_port_is_a_clear_bind_error(free_port: int) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port))
        taken.listen()
        with pytest.raises(VaultBindError, match=f"bulk data on 127.0.0.1:{free_port}"):
            serve("127.0.0.1:0", 0, bulk_port=free_port)


def test_receive_buffers_are_reused_only_when_no_view_is_left() -> None:
    pool = ReceiveBuffers(1024, 2048)
    first = pool.take()
    view = first.data[:10].toreadonly()
    del first
    second = pool.take()
    assert second is not pool._buffers[0]  # the view still holds the first buffer
    del view, second
    assert pool.take() is pool._buffers[0]
    assert len(pool._buffers) == 2
    extra = [pool.take() for _ in range(3)]  # beyond the cap: not kept
    assert len(pool._buffers) == 2 and len({id(b) for b in extra}) == 3


def test_huge_page_tunable_is_added_once() -> None:
    assert with_huge_pages({})["GLIBC_TUNABLES"] == HUGE_PAGE_TUNABLE
    assert with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == (
        f"glibc.malloc.arena_max=2:{HUGE_PAGE_TUNABLE}"
    )
    kept = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert with_huge_pages(kept) == kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables")
def test_tierkv_vault_runs_with_a_huge_page_heap(vault_factory: Callable) -> None:
    vault: Any = vault_factory(subprocess=True)
    environ = Path(f"/proc/{vault.process.pid}/environ").read_bytes().split(b"\0")
    expected = with_huge_pages(os.environ)["GLIBC_TUNABLES"]
    assert f"GLIBC_TUNABLES={expected}".encode() in environ


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no ::1 on this machine")
def test_bulk_path_over_ipv6_loopback() -> None:
    server = serve("[::1]:0", 0)
    try:
        with VaultClient(server.address) as client:
            client.put(NS, key(6), 0, b"six")
            assert client.flush(timeout=10)
            assert client.promote(NS, [key(6)], [0]) == {(0, 0): b"six"}
            assert client.transport == "bulk"
    finally:
        server.stop(grace=0)


class _VaultBeforeHello(vault_pb2_grpc.VaultServicer):
    """A vault of an earlier version: Stats, and no Hello (nor anything else)."""

    def Stats(self, request: Any, context: Any) -> vault_pb2.StatsReply:
        return vault_pb2.StatsReply(role="kv_cold", version="0.0.1")


def test_a_vault_that_predates_hello_is_up_without_bulk_path(free_port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    vault_pb2_grpc.add_VaultServicer_to_server(_VaultBeforeHello(), server)
    server.add_insecure_port(f"127.0.0.1:{free_port}")
    server.start()
    try:
        with VaultClient(f"127.0.0.1:{free_port}") as client:
            assert client.bulk_path() == (0, False)
            assert client.promote(NS, [key(1)], [0]) == {}  # its gRPC Promote: a plain miss
            assert client.failed_calls == 1
    finally:
        server.stop(grace=0)


def test_many_small_frames_are_all_answered(vault: Any) -> None:
    # Alternating namespaces make one PUT frame per block: thousands of summaries to read back.
    namespaces = [b"a" * 16, b"z" * 16]
    with VaultClient(vault.address) as client:
        for i in range(3000):
            client.put(namespaces[i % 2], key(i), 0, payload(i, 64))
        assert client.flush(timeout=60)
        assert (client.stored_puts, client.failed_puts, client.transport) == (3000, 0, "bulk")
    assert vault.store.stats().entries == 3000


def test_a_client_refused_on_the_bulk_port_falls_back_to_grpc() -> None:
    server = serve("127.0.0.1:0", 0, limits=LimitsConfig(max_connections_per_client=1))
    try:
        with _bulk_socket(server.bulk_port), VaultClient(server.address) as client:
            client.put(NS, key(1), 0, b"over grpc")  # the only bulk slot is taken
            assert client.flush(timeout=10) and client.stored_puts == 1
            assert client.promote(NS, [key(1)], [0]) == {(0, 0): b"over grpc"}
            assert client.transport == "grpc" and client.breaker_state == "closed"
    finally:
        server.stop(grace=0)


class _SilentBulkPort(vault_pb2_grpc.VaultServicer):
    """A gRPC face (every data call UNIMPLEMENTED) whose bulk port accepts and says nothing."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))

    def Hello(self, request: Any, context: Any) -> vault_pb2.HelloReply:
        return vault_pb2.HelloReply(bulk_port=self.listener.getsockname()[1])


def test_a_bulk_connection_refused_or_never_welcomed_counts_toward_the_breaker() -> None:
    server = serve("127.0.0.1:0", 0, limits=LimitsConfig(max_connections_per_client=1))
    try:
        with _bulk_socket(server.bulk_port), VaultClient(server.address) as client:
            client.put(NS, key(1), 0, b"over grpc")  # refused on the bulk port, then gRPC
            assert client.flush(timeout=10) and client.stored_puts == 1
            assert client.failed_calls == 1
    finally:
        server.stop(grace=0)
    silent = _SilentBulkPort()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    vault_pb2_grpc.add_VaultServicer_to_server(silent, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        with VaultClient(f"127.0.0.1:{port}", deadline_s=0.5, breaker_failures=2) as client:
            assert client.promote(NS, [key(1)], [0]) == {}  # no welcome in time, then gRPC fails
            assert client.failed_calls == 2 and client.breaker_state == "open"
    finally:
        grpc_server.stop(grace=0)
        silent.listener.close()
