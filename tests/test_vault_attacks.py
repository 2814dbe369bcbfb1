"""A hostile peer against a real `tierkv vault` process on loopback, one attack per test.

Each attack is what issue 10 found taking the vault out of service. The vault has three tenants:
the attacker, a victim whose acknowledged blocks are stored before the attack, and a normal
client. During every attack the normal client's Put + Lookup + Promote of a few blocks must still
succeed within its deadline, the vault's peak resident memory (VmHWM: the vault is fresh per
test) stay under its cap + 256 MiB, and no acknowledged block of the victim be lost. Limits are
configured low so each attack runs in seconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import SLOW_BOX_MARGIN_S, key, wait_until

from tierkv.backends.security import proving_channel
from tierkv.backends.vault import VaultClient
from tierkv.backends.vault_bulk import BulkConnection, BulkRefused
from tierkv.checksum import block_checksum
from tierkv.config import LimitsConfig
from tierkv.vault.limits import max_put_index_bytes
from tierkv.wire._pb import vault_pb2, vault_pb2_grpc
from tierkv.wire.framing import AUTH, CHALLENGE, HEADER, MAGIC, PROMOTE_REPLY, PUT, WELCOME
from tierkv.wire.messages import encode_bulk
from tierkv.wire.proofs import proof

MIB = 1024 * 1024
CAP = 256 * MIB
DEADLINE_S = 2.0
PROMOTE_DEADLINE_S = 5.0
STALL_MARGIN_S = SLOW_BOX_MARGIN_S
"""How far past its deadline a normal call may return on a loaded 2-core machine."""
LOW_LIMITS = """
[limits]
handshake_timeout_s = 1.0
idle_timeout_s = 5.0
stall_timeout_s = 2.0
max_connections_per_client = 32
max_concurrent_rpcs = 16
stream_timeout_s = 3.0
max_inflight_bytes = "64MiB"
max_message_bytes = "16MiB"
"""
STREAM_SLOTS = 16 // 2
"""Put and Promote streams LOW_LIMITS' vault serves at once (half of max_concurrent_rpcs)."""
VICTIM_NS = b"v" * 16
ATTACKER_NS = b"a" * 16
VICTIM = "victim-token-0123456789abcdef"
ATTACKER = "attacker-token-0123456789abcd"
NORMAL = "normal-token-0123456789abcdef"
WORST_STALL: dict[str, float] = {}
"""Attack → the slowest normal call during it, in seconds (printed for the closing note)."""
PEAK_RSS: dict[str, int] = {}
"""Attack → the vault's peak resident memory (VmHWM), in bytes (printed for the closing note)."""


@pytest.fixture(scope="module", autouse=True)
def closing_note() -> Iterator[None]:
    """Not a check: once this module's tests ran, the figures they measured, for the closing
    note (run with -s); a test of its own would depend on the others having run first."""
    yield
    for attack, seconds in sorted(WORST_STALL.items()):
        rss = PEAK_RSS.get(attack)
        memory = f", vault peak RSS {rss / MIB:.0f} MiB" if rss else ""
        print(f"{attack}: worst normal call {seconds:.2f} s{memory}")


def peak_rss_bytes(pid: int) -> int:
    """The most resident memory process `pid` ever had (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def token_file(directory: Path, **tokens: str) -> Path:
    """A vault's token file (0600, as the vault requires): one "tenant token" line each."""
    path = directory / "tokens"
    path.write_text("".join(f"{tenant} {token}\n" for tenant, token in tokens.items()))
    path.chmod(0o600)
    return path


@pytest.fixture
def vault(vault_factory: Callable[..., Any], tmp_path: Path) -> Any:
    tokens = token_file(tmp_path, victim=VICTIM, attacker=ATTACKER, normal=NORMAL)
    config = f'{LOW_LIMITS}\n[security]\ntoken_file = "{tokens}"\n'
    handle = vault_factory(max_bytes="256MiB", subprocess=True, config=config, token=VICTIM)
    with VaultClient(handle.address, token=VICTIM) as client:
        handle.bulk_port = client.bulk_path()[0]
        for i in range(8):  # the victim's acknowledged blocks, checked after each attack
            client.put(VICTIM_NS, key(i), 0, bytes([i + 1]) * 4096)
        assert client.flush(timeout=10) and client.stored_puts == 8
    return handle


def normal_client_works(address: str, attack: str, tag: int) -> None:
    """A normal client's Put + Lookup + Promote of four blocks, each within its deadline."""
    ns = b"n" * 15 + bytes([tag])
    blocks = {i: os.urandom(2048) for i in range(4)}
    with VaultClient(
        address, deadline_s=DEADLINE_S, promote_deadline_s=PROMOTE_DEADLINE_S, token=NORMAL
    ) as client:
        started = time.monotonic()
        for i, payload in blocks.items():
            client.put(ns, key(i), 0, payload)
        assert client.flush(timeout=DEADLINE_S + 4 * STALL_MARGIN_S), client.counters()
        put_s = time.monotonic() - started
        started = time.monotonic()
        assert client.lookup(ns, [key(i) for i in blocks], [0]) == len(blocks)
        lookup_s = time.monotonic() - started
        started = time.monotonic()
        found = client.promote(ns, [key(i) for i in blocks], [0])
        promote_s = time.monotonic() - started
        assert {k: bytes(v) for k, v in found.items()} == {(i, 0): p for i, p in blocks.items()}
    assert lookup_s < DEADLINE_S + STALL_MARGIN_S
    assert promote_s < PROMOTE_DEADLINE_S + STALL_MARGIN_S
    WORST_STALL[attack] = max(WORST_STALL.get(attack, 0.0), put_s, lookup_s, promote_s)


def vault_is_whole(vault: Any, attack: str) -> None:
    """The vault process lives, never grew past cap + 256 MiB, and kept the victim's blocks."""
    assert vault.process.poll() is None, "the vault died"
    PEAK_RSS[attack] = peak_rss_bytes(vault.process.pid)
    assert PEAK_RSS[attack] < CAP + 256 * MIB
    with VaultClient(vault.address, token=VICTIM) as client:
        found = client.promote(VICTIM_NS, [key(i) for i in range(8)], [0])
        assert {k: bytes(v) for k, v in found.items()} == {
            (i, 0): bytes([i + 1]) * 4096 for i in range(8)
        }


def closed_by_vault(sock: socket.socket, timeout: float) -> bool:
    """Whether the vault closes `sock` within `timeout` (whatever it sent before)."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            if sock.recv(1 << 16) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


def bulk_socket(port: int) -> socket.socket:
    """A raw bulk connection of the attacker, past the handshake."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    _, kind, index_len, _ = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
    assert kind == CHALLENGE
    challenge = vault_pb2.BulkChallenge.FromString(sock.recv(index_len, socket.MSG_WAITALL))
    answer = vault_pb2.BulkAuth(proof=proof(ATTACKER, challenge.nonce)).SerializeToString()
    sock.sendall(HEADER.pack(MAGIC, AUTH, len(answer), 0) + answer)
    _, kind, index_len, _ = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
    assert kind == WELCOME and index_len == 0
    return sock


def test_idle_bulk_connections_neither_block_clients_nor_stay(vault: Any) -> None:
    idle = []
    for _ in range(256):
        with contextlib.suppress(OSError):  # the backlog is full: refused is fine too
            idle.append(socket.create_connection(("127.0.0.1", vault.bulk_port), timeout=5))
    try:
        normal_client_works(vault.address, "256 idle bulk connections", 1)
        # Past the handshake timeout every one of them is gone.
        assert all(closed_by_vault(sock, 10) for sock in idle)
    finally:
        for sock in idle:
            sock.close()
    normal_client_works(vault.address, "256 idle bulk connections", 2)
    vault_is_whole(vault, "256 idle bulk connections")


@contextlib.contextmanager
def _channel_of(
    token: str, address: str, options: Sequence[tuple[str, Any]] = ()
) -> Iterator[grpc.Channel]:
    """A plain gRPC channel whose calls carry a proof of `token`."""
    with grpc.insecure_channel(address, options=options) as channel:
        yield proving_channel(channel, token)


def _health_answers(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _a_stream_slot_is_free(address: str) -> bool:
    """Whether a Promote stream of a fresh connection is served (not refused for want of a
    stream slot); it asks for a block nobody stored, so nothing else can refuse it."""
    request = vault_pb2.PromoteRequest(namespace=ATTACKER_NS, keys=[key(999)], parts=[0])
    with _channel_of(ATTACKER, address) as channel:
        try:
            list(vault_pb2_grpc.VaultStub(channel).Promote(request, timeout=DEADLINE_S))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return False
            raise
    return True


def _ended_by_vault(calls: list[Any], streamed: bool = False) -> list[grpc.StatusCode]:
    """How each held-open call ended (the vault ends them all: limit or stream_timeout_s)."""
    codes = []
    for call in calls:
        try:
            list(call) if streamed else call.result(timeout=15)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    return codes


def test_put_streams_nobody_finishes_are_limited_and_cancelled(vault: Any) -> None:
    stop = threading.Event()

    def never_ending() -> Iterator[bytes]:
        stop.wait(30)
        yield from ()

    with _channel_of(ATTACKER, vault.address) as channel:
        put = channel.stream_unary("/tierkv.v1.Vault/Put", request_serializer=lambda b: b)
        puts = [put.future(never_ending()) for _ in range(32)]
        try:  # the vault holds STREAM_SLOTS of them and refuses the rest
            assert wait_until(lambda: sum(p.done() for p in puts) >= 32 - STREAM_SLOTS, 15)
            normal_client_works(vault.address, "32 Put streams never finished", 3)
            _health_answers(channel)
            codes = _ended_by_vault(puts)
        finally:
            stop.set()
    assert set(codes) == {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    vault_is_whole(vault, "32 Put streams never finished")


def test_promote_streams_nobody_reads_are_limited_and_cancelled(vault: Any) -> None:
    big = os.urandom(4 * MIB)
    with VaultClient(vault.address, token=ATTACKER) as attacker:  # something worth promoting
        for i in range(8):
            attacker.put(ATTACKER_NS, key(i), 0, big)
        assert attacker.flush(timeout=30)
    request = vault_pb2.PromoteRequest(
        namespace=ATTACKER_NS, keys=[key(i) for i in range(8)], parts=[0]
    )
    with _channel_of(ATTACKER, vault.address) as channel:
        stub = vault_pb2_grpc.VaultStub(channel)
        promotes = [stub.Promote(request, timeout=60) for _ in range(40)]
        # The vault holds STREAM_SLOTS of them and refuses the rest...
        assert wait_until(lambda: sum(p.done() for p in promotes) >= 40 - STREAM_SLOTS, 15)
        normal_client_works(vault.address, "40 Promote streams never read", 8)
        _health_answers(channel)
        # stream_timeout_s later the vault has cancelled what it was still sending: its stream
        # slots are free again
        assert wait_until(lambda: _a_stream_slot_is_free(vault.address), 15)
        codes = _ended_by_vault(promotes, streamed=True)
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert set(codes) <= {
        grpc.StatusCode.OK,  # read after all, once the vault had sent everything
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
    vault_is_whole(vault, "40 Promote streams never read")


def test_a_huge_promote_or_lookup_is_refused_at_once(vault: Any) -> None:
    keys = [os.urandom(16) for _ in range(10_000)]
    request = vault_pb2.PromoteRequest(namespace=ATTACKER_NS, keys=keys, parts=range(10_000))
    assert 150_000 < request.ByteSize() < 300_000  # one ~200 KB request
    with _channel_of(ATTACKER, vault.address) as channel:
        stub = vault_pb2_grpc.VaultStub(channel)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failure:
            list(stub.Promote(request, timeout=10))
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_blocks_per_request" in (failure.value.details() or "")
        lookup = vault_pb2.LookupRequest(namespace=ATTACKER_NS, keys=keys, parts=range(10_000))
        with pytest.raises(grpc.RpcError) as failure:
            stub.Lookup(lookup, timeout=10)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert time.monotonic() - started < 5
        # Within the limit, a big request shares the store: 8 of them at once, while others run.
        big = vault_pb2.LookupRequest(namespace=VICTIM_NS, keys=keys[:6000], parts=range(10))
        calls = [stub.Lookup.future(big, timeout=30) for _ in range(8)]
        normal_client_works(vault.address, "10,000 keys x 10,000 parts Promote/Lookup", 4)
        assert all(call.result().present == 0 for call in calls)
    vault_is_whole(vault, "10,000 keys x 10,000 parts Promote/Lookup")


def test_an_empty_parts_lookup_finds_nothing(vault: Any) -> None:
    with _channel_of(VICTIM, vault.address) as channel:
        stub = vault_pb2_grpc.VaultStub(channel)
        request = vault_pb2.LookupRequest(namespace=VICTIM_NS, keys=[key(0), key(99)])
        assert stub.Lookup(request, timeout=5).present == 0  # key(0) is stored, key(99) is not


def _bulk_frame(index: vault_pb2.PutIndex, data: bytes = b"") -> bytes:
    raw = index.SerializeToString()
    return HEADER.pack(MAGIC, PUT, len(raw), len(data)) + raw + data


def closed_or_refused(sock: socket.socket, timeout: float = 10) -> bool:
    """The vault closed the connection, or answered a PUT summary storing nothing."""
    sock.settimeout(timeout)
    try:
        head = sock.recv(HEADER.size, socket.MSG_WAITALL)
    except ConnectionResetError:
        return True
    if not head:
        return True
    _, _, index_len, _ = HEADER.unpack(head)
    summary = vault_pb2.PutSummary.FromString(sock.recv(index_len, socket.MSG_WAITALL))
    return summary.stored == 0


def test_frames_of_zero_length_payloads_cost_little_and_store_nothing(vault: Any) -> None:
    millions = vault_pb2.PutIndex(namespace=ATTACKER_NS)
    millions.keys.extend([b"k"] * 2_000_000)
    millions.parts.extend([0] * 2_000_000)
    millions.lengths.extend([0] * 2_000_000)
    millions.checksums.extend([0] * 2_000_000)
    within = vault_pb2.PutIndex(namespace=ATTACKER_NS)
    for i in range(60_000):
        within.keys.append(key(i))
        within.parts.append(0)
        within.lengths.append(0)
        within.checksums.append(block_checksum(ATTACKER_NS, key(i), 0, b""))
    frames = [_bulk_frame(millions), _bulk_frame(within)]
    sockets = [bulk_socket(vault.bulk_port) for _ in frames]

    def send(sock: socket.socket, frame: bytes) -> None:
        with contextlib.suppress(OSError):  # the vault may close before it is all sent
            sock.sendall(frame)

    for sock, frame in zip(sockets, frames, strict=True):
        threading.Thread(target=send, args=(sock, frame), daemon=True).start()
    normal_client_works(vault.address, "bulk frames of 2M / 60k zero-length payloads", 5)
    assert all(closed_or_refused(sock) for sock in sockets)
    for sock in sockets:
        sock.close()
    with VaultClient(vault.address, token=ATTACKER) as client:
        assert client.lookup(ATTACKER_NS, [key(0)], [0]) == 0
    vault_is_whole(vault, "bulk frames of 2M / 60k zero-length payloads")


def test_oversize_payloads_are_refused_before_they_are_received(vault: Any) -> None:
    headers = [
        HEADER.pack(MAGIC, PUT, 0, 12 * 1024**3),  # 12 GiB claimed
        *[HEADER.pack(MAGIC, PUT, 0, 300 * MIB) for _ in range(4)],  # each over the cap
    ]
    sockets = [bulk_socket(vault.bulk_port) for _ in headers]
    for sock, header in zip(sockets, headers, strict=True):
        sock.sendall(header)
    sent_after = []

    def stream_junk(sock: socket.socket) -> None:
        sent = 0
        try:
            chunk = b"\0" * MIB
            while sent < 300 * MIB:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        sent_after.append(sent)

    threads = [threading.Thread(target=stream_junk, args=(s,)) for s in sockets[1:]]
    for thread in threads:
        thread.start()
    # Over gRPC: a message over limits.max_message_bytes.
    unlimited = [("grpc.max_send_message_length", -1)]
    with _channel_of(ATTACKER, vault.address, unlimited) as ch:
        put = ch.stream_unary("/tierkv.v1.Vault/Put", request_serializer=lambda b: b)
        payload = b"\0" * (40 * MIB)
        index = vault_pb2.PutIndex(
            namespace=ATTACKER_NS, keys=[key(1)], parts=[0], lengths=[len(payload)], checksums=[0]
        )
        with pytest.raises(grpc.RpcError) as failure:
            put(iter([encode_bulk(index, [payload])]), timeout=20)
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    normal_client_works(vault.address, "12 GiB header + 4 frames over the cap", 6)
    for thread in threads:
        thread.join(timeout=30)
    assert all(closed_by_vault(sock, 10) for sock in sockets)
    assert max(sent_after) < 300 * MIB  # nobody received them whole
    for sock in sockets:
        sock.close()
    vault_is_whole(vault, "12 GiB header + 4 frames over the cap")


def test_grpc_put_messages_are_admitted_before_they_are_received(
    vault_factory: Callable[..., Any],
) -> None:
    """32 Put streams, each sending one 15 MiB message at once (rejected: a wrong checksum), to
    a vault receiving at most 32 MiB of Put messages: gRPC no longer holds them all at once
    (~480 MiB before admission came first)."""
    limits = '[limits]\nmax_concurrent_rpcs = 64\nmax_message_bytes = "16MiB"\n'
    limits += 'max_inflight_bytes = "32MiB"\nstall_timeout_s = 60.0\n'
    vault = vault_factory(max_bytes="256MiB", subprocess=True, config=limits)
    before = peak_rss_bytes(vault.process.pid)
    payload = b"\0" * (15 * MIB)
    index = vault_pb2.PutIndex(
        namespace=ATTACKER_NS, keys=[key(1)], parts=[0], lengths=[len(payload)], checksums=[0]
    )
    message = encode_bulk(index, [payload])
    unlimited = [("grpc.max_send_message_length", -1)]
    with _channel_of(ATTACKER, vault.address, unlimited) as ch:
        put = ch.stream_unary(
            "/tierkv.v1.Vault/Put",
            request_serializer=lambda b: b,
            response_deserializer=vault_pb2.PutSummary.FromString,
        )
        calls = [put.future(iter([message]), timeout=120) for _ in range(32)]
        normal_client_works(vault.address, "32 gRPC Put messages of 15 MiB at once", 9)
        summaries = [call.result() for call in calls]
    assert all(summary.rejected == 1 and summary.stored == 0 for summary in summaries)
    grown = peak_rss_bytes(vault.process.pid) - before
    PEAK_RSS["32 gRPC Put messages of 15 MiB at once"] = peak_rss_bytes(vault.process.pid)
    print(f"32 gRPC Put messages of 15 MiB: the vault's peak grew by {grown / MIB:.0f} MiB")
    assert grown < 160 * MIB, f"the vault grew by {grown / MIB:.0f} MiB"
    assert vault.process.poll() is None


def test_tiny_blocks_and_long_keys_cannot_outgrow_the_cap(vault: Any) -> None:
    with VaultClient(vault.address, max_pending_bytes=512 * MIB, token=ATTACKER) as attacker:
        for i in range(400_000):  # 400k entries of 1049 bytes: more than the cap
            attacker.put(ATTACKER_NS, struct.pack("<Q", i), 0, b"x")
            if i % 100_000 == 0:
                attacker.flush(timeout=60)
        long_key = b"k" * MIB
        for i in range(50):
            attacker.put(ATTACKER_NS, long_key + bytes([i]), 0, b"y")
            attacker.put(b"n" * MIB + bytes([i]), key(i), 0, b"z")
        attacker.flush(timeout=120)
        assert attacker.lookup(ATTACKER_NS, [long_key + b"\0"], [0]) == 0  # refused
        stats = attacker.stats()
    assert stats.bytes_used <= CAP
    assert stats.evictions > 0
    normal_client_works(vault.address, "400k one-byte blocks, 1 MiB keys and namespaces", 7)
    # The flood evicted the attacker's own oldest blocks, never the victim's (within its share).
    vault_is_whole(vault, "400k one-byte blocks, 1 MiB keys and namespaces")


class _EvilVault(vault_pb2_grpc.VaultServicer):
    """A gRPC face that points clients at a hostile bulk port."""

    def __init__(self, bulk_port: int) -> None:
        self.bulk_port = bulk_port

    def Hello(self, request: Any, context: Any) -> vault_pb2.HelloReply:
        return vault_pb2.HelloReply(bulk_port=self.bulk_port)


def _hostile_bulk_peer(reply: Callable[[socket.socket], None]) -> tuple[socket.socket, int]:
    """A bulk port that welcomes a client as a vault would, then answers with `reply`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def welcome_then_reply(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(HEADER.pack(MAGIC, CHALLENGE, 0, 0))
            _, _, index_len, _ = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
            sock.recv(index_len, socket.MSG_WAITALL)
            sock.sendall(HEADER.pack(MAGIC, WELCOME, 0, 0))
            reply(sock)

    def serve() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=welcome_then_reply, args=(sock,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener, listener.getsockname()[1]


def _trickle(sock: socket.socket) -> None:
    try:
        sock.recv(1 << 16)
        for byte in HEADER.pack(MAGIC, PROMOTE_REPLY, 0, 1 << 20) * 100:
            sock.sendall(bytes([byte]))
            time.sleep(0.3)
    except OSError:
        pass


def _claim_a_terabyte(sock: socket.socket) -> None:
    try:
        sock.recv(1 << 16)
        index = vault_pb2.PromoteIndex(key_indices=[0], parts=[0], lengths=[1 << 40])
        raw = index.SerializeToString()
        sock.sendall(HEADER.pack(MAGIC, PROMOTE_REPLY, len(raw), 1 << 40) + raw)
        time.sleep(30)
    except OSError:
        pass


@pytest.mark.parametrize("peer", [_trickle, _claim_a_terabyte], ids=["trickle", "terabyte"])
def test_a_hostile_bulk_peer_costs_a_promote_its_deadline_and_never_raises(
    peer: Callable[[socket.socket], None], free_port: int
) -> None:
    listener, bulk_port = _hostile_bulk_peer(peer)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    vault_pb2_grpc.add_VaultServicer_to_server(_EvilVault(bulk_port), server)
    server.add_insecure_port(f"127.0.0.1:{free_port}")
    server.start()
    try:
        with VaultClient(f"127.0.0.1:{free_port}", deadline_s=1.0, promote_deadline_s=2.0) as c:
            started = time.monotonic()
            assert c.promote(VICTIM_NS, [key(0)], [0]) == {}
            took = time.monotonic() - started
            assert c.failed_calls >= 1
        WORST_STALL[f"hostile bulk peer ({peer.__name__})"] = took
        assert took < 2.0 + STALL_MARGIN_S  # ~2.0 s measured; the margin is for a loaded box
    finally:
        server.stop(grace=0)
        listener.close()


PER_TENANT = 4
"""limits.max_connections_per_tenant of the connection-hoarding test (an address may hold 8)."""


def _closed_within(connection: BulkConnection, timeout: float) -> bool:
    """Whether the vault closes the (idle) `connection` within `timeout`."""
    return wait_until(lambda: not connection.is_open(), timeout, interval=0.05)


def test_a_tenant_holding_its_bulk_connections_leaves_the_others_theirs(
    vault_factory: Callable[..., Any], tmp_path: Path
) -> None:
    tokens = token_file(tmp_path, attacker=ATTACKER, normal=NORMAL)
    config = f"""
[limits]
max_connections_per_client = {2 * PER_TENANT}
max_connections_per_tenant = {PER_TENANT}
handshake_timeout_s = 1.0
idle_timeout_s = 2.0
[security]
token_file = "{tokens}"
"""
    handle = vault_factory(subprocess=True, config=config, token=NORMAL)
    with VaultClient(handle.address, token=NORMAL) as probe:
        port = probe.bulk_path()[0]
    hoarded = [BulkConnection("127.0.0.1", port, 5.0, ATTACKER) for _ in range(PER_TENANT)]
    try:
        with pytest.raises(BulkRefused, match="max_connections_per_tenant"):
            BulkConnection("127.0.0.1", port, 5.0, ATTACKER)  # one more of the same tenant
        # The address has room for another tenant's connections, and they are not pushed to gRPC.
        with VaultClient(handle.address, token=NORMAL) as client:
            client.put(VICTIM_NS, key(1), 0, b"over the bulk port")
            assert client.flush(timeout=10)
            assert client.promote(VICTIM_NS, [key(1)], [0]) == {(0, 0): b"over the bulk port"}
            assert (client.transport, client.bulk_refusals, client.failed_calls) == ("bulk", 0, 0)
        # Idle authenticated connections are closed after idle_timeout_s, freeing their slots.
        assert all(_closed_within(c, 2.0 + STALL_MARGIN_S) for c in hoarded)
        BulkConnection("127.0.0.1", port, 5.0, ATTACKER).close()
    finally:
        for connection in hoarded:
            connection.close()


def _the_tenants_last_slot(port: int) -> BulkConnection:
    """A bulk connection of ATTACKER's, once the vault has let go of the one the client's probe
    of the port held a moment ago."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            return BulkConnection("127.0.0.1", port, 5.0, ATTACKER)
        except BulkRefused:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_client_refused_at_its_tenants_limit_uses_grpc_without_a_failure(
    vault_factory: Callable[..., Any], tmp_path: Path
) -> None:
    tokens = token_file(tmp_path, attacker=ATTACKER, normal=NORMAL)
    config = f'[limits]\nmax_connections_per_tenant = 1\n[security]\ntoken_file = "{tokens}"\n'
    handle = vault_factory(subprocess=True, config=config, token=NORMAL)
    with VaultClient(handle.address, token=ATTACKER) as client:
        port = client.bulk_path()[0]
        with contextlib.closing(_the_tenants_last_slot(port)):
            assert client.bulk_path() == (port, True)  # refused with a reason: it answered
            assert client.promote(ATTACKER_NS, [key(1)], [0]) == {}
            counters = client.counters()
        assert (counters["transport"], counters["bulk_refusals"]) == ("grpc", 1)
        assert (counters["failed_calls"], client.breaker_state) == (0, "closed")


def test_a_put_index_larger_than_any_request_is_refused_from_its_header(vault: Any) -> None:
    """A PUT frame announcing a 15 MB index (no request within the limits has one larger than
    max_put_index_bytes, 6.3 MB by default) is refused before its index is received: eight of
    them at once grew a vault by about 1 GiB while it parsed them."""
    limit = max_put_index_bytes(LimitsConfig())
    sock = bulk_socket(vault.bulk_port)
    with sock:
        sock.sendall(HEADER.pack(MAGIC, PUT, 15_000_000, 0))
        sock.settimeout(1.0)  # less than the fixture's stall_timeout_s: refused, not timed out
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            closed = False  # still waiting for the 15 MB
    assert closed and limit < 15_000_000


def test_promote_streams_nobody_reads_hold_no_more_than_the_in_flight_budget(
    vault_factory: Callable[..., Any],
) -> None:
    """16 gRPC Promote streams of one 16 MiB block, never read, on a vault sending at most
    32 MiB at once: a block gRPC has taken into its send buffers still counts until the reader
    takes it (it used to be let go once handed to gRPC, so each unread stream held one more)."""
    limits = '[limits]\nmax_concurrent_rpcs = 64\nmax_inflight_bytes = "32MiB"\n'
    limits += "stream_timeout_s = 20.0\nstall_timeout_s = 2.0\n"
    vault = vault_factory(max_bytes="1GiB", subprocess=True, config=limits)
    block = os.urandom(16 * MIB)
    with VaultClient(vault.address) as client:
        client.put(ATTACKER_NS, key(1), 0, block)
        assert client.flush(timeout=60)
    before = peak_rss_bytes(vault.process.pid)
    request = vault_pb2.PromoteRequest(namespace=ATTACKER_NS, keys=[key(1)], parts=[0])
    with grpc.insecure_channel(vault.address) as channel:
        stub = vault_pb2_grpc.VaultStub(channel)
        promotes = [stub.Promote(request, timeout=60) for _ in range(16)]
        # stall_timeout_s later, the streams that found no room (all but two) have given up
        assert wait_until(lambda: sum(p.done() for p in promotes) >= 14, 15)
        grown = peak_rss_bytes(vault.process.pid) - before
        for call in promotes:
            call.cancel()
    print(f"\n16 unread Promote streams of 16 MiB: vault RSS +{grown / MIB:.0f} MiB (budget 32)")
    assert grown < 96 * MIB
