"""A real vault on a loopback port driven by the real client: every RPC end to end."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import alias_entry, key

from tierkv.backends.base import BackendUnavailable
from tierkv.backends.vault import VaultClient
from tierkv.checksum import block_checksum
from tierkv.vault.server import (
    CHUNK_BYTES,
    MAX_REPORTED_REJECTIONS,
    SERVICE_NAME,
    VaultBindError,
    serve,
)
from tierkv.vault.store import entry_bytes
from tierkv.wire._pb import vault_pb2
from tierkv.wire.messages import encode_bulk

NS = b"n" * 16
MIB = 1024 * 1024


def payload_for(i: int, part: int, size: int) -> bytes:
    return (bytes([i % 251, part]) + os.urandom(16)) * (size // 18) + b"z" * (size % 18)


def test_put_lookup_promote_round_trip(vault: Any) -> None:
    with VaultClient(vault.address) as client:
        blocks = {(i, p): payload_for(i, p, 1000 + 37 * i) for i in range(8) for p in (0, 1)}
        for (i, p), payload in blocks.items():
            client.put(NS, key(i), p, payload)
        assert client.flush(timeout=10)
        assert client.stored_puts == 16
        keys = [key(i) for i in range(10)]
        assert client.lookup(NS, keys, [0, 1]) == 8
        assert client.lookup(NS, keys, [0, 2]) == 0
        found = client.promote(NS, keys, [0, 1])
        assert {k: bytes(v) for k, v in found.items()} == blocks
        stats = client.stats()
        assert stats.entries == 16
        assert stats.bytes_used == sum(
            entry_bytes(NS, key(i), len(p)) for (i, _), p in blocks.items()
        )
        assert (stats.hits, stats.misses) == (16, 4)
        assert stats.role == "kv_cold" and stats.max_bytes == 1024**3


def test_memoryview_puts_are_copied_before_returning(vault: Any) -> None:
    buffer = bytearray(b"a" * 100)
    with VaultClient(vault.address) as client:
        client.put(NS, key(1), 0, memoryview(buffer))
        buffer[:] = b"b" * 100
        assert client.flush(timeout=10)
        assert bytes(client.promote(NS, [key(1)], [0])[(0, 0)]) == b"a" * 100


def test_oversize_put_is_reported_rejected_not_stored(vault_factory: Callable) -> None:
    vault = vault_factory(max_bytes=2000)
    with VaultClient(vault.address) as client:
        client.put(NS, key(1), 0, b"x" * 2001)
        client.put(NS, key(2), 0, b"y" * 10)
        assert client.flush(timeout=10)
        assert (client.stored_puts, client.rejected_puts) == (1, 1)
        assert "exceeds the vault cap" in client.last_rejections[0]
        assert client.lookup(NS, [key(1)], [0]) == 0
        assert client.stats().bytes_used == entry_bytes(NS, key(2), 10)


def test_corrupted_payload_is_a_counted_miss(vault: Any) -> None:
    good = b"g" * 4096
    rotting = bytearray(b"r" * 4096)
    vault.store.put(NS, key(0), 0, good, block_checksum(NS, key(0), 0, good))
    vault.store.put(NS, key(1), 0, memoryview(rotting), block_checksum(NS, key(1), 0, rotting))
    rotting[100] ^= 0xFF  # bit rot in the vault's RAM after the checksum was verified
    with VaultClient(vault.address) as client:
        found = client.promote(NS, [key(0), key(1)], [0])
        assert list(found) == [(0, 0)]
        assert client.checksum_failures == 1
        assert client.breaker_state == "closed"


def test_payload_returned_under_another_key_is_a_counted_miss(vault: Any) -> None:
    """Bytes the vault files or returns under the wrong key (a bug, a flipped index) fail the
    reader's checksum like corrupted ones: a miss, never another block's KV."""
    payload = b"k" * 4096
    vault.store.put(NS, key(0), 0, payload, block_checksum(NS, key(0), 0, payload))
    alias_entry(vault.store, (NS, key(0), 0), key(1))  # key(0)'s entry also under key(1)
    with VaultClient(vault.address) as client:
        found = client.promote(NS, [key(0), key(1)], [0])
        assert list(found) == [(0, 0)]
        assert client.checksum_failures == 1


def test_malformed_put_batch_is_rejected_with_a_reason(vault: Any) -> None:
    index = vault_pb2.PutIndex(namespace=NS, keys=[key(1)], parts=[0], lengths=[10], checksums=[0])
    with grpc.insecure_channel(vault.address) as channel:
        put = channel.stream_unary(
            f"/{SERVICE_NAME}/Put", response_deserializer=vault_pb2.PutSummary.FromString
        )
        summary = put(iter([encode_bulk(index, [b"short"])]), timeout=5)
    assert summary.rejected == 1 and "malformed" in summary.rejections[0].reason
    assert vault.store.stats().entries == 0


@pytest.mark.parametrize(
    "method", ["Put", "Promote", "Lookup", "Stats", "Delete", "Clear", "Hello"]
)
def test_a_request_that_does_not_parse_is_answered_invalid_argument(
    vault: Any, method: str
) -> None:
    """Regression: bytes no protobuf parser takes were answered INTERNAL ("Exception
    deserializing request!"), which reads as the vault's fault; the caller sent them."""
    garbage = b"\xff" * 12  # a field tag that is a varint running past the end
    with grpc.insecure_channel(vault.address) as channel:
        path = f"/{SERVICE_NAME}/{method}"
        with pytest.raises(grpc.RpcError) as raised:
            if method == "Put":
                channel.stream_unary(path)(iter([garbage]), timeout=5)
            elif method == "Promote":
                list(channel.unary_stream(path)(garbage, timeout=5))
            else:
                channel.unary_unary(path)(garbage, timeout=5)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
        assert "malformed" in (raised.value.details() or "")
        with VaultClient(vault.address) as client:  # and the vault serves on
            assert client.lookup(NS, [key(0)], [0]) == 0 and client.stats().entries == 0


def test_put_stream_counts_every_rejection_and_reports_at_most_the_cap(vault: Any) -> None:
    """Rejections add up across the batches of one stream; reasons stop at the cap."""
    batches = []
    for batch in range(3):
        keys = [key(batch * 60 + i) for i in range(60)]
        index = vault_pb2.PutIndex(
            namespace=NS, keys=keys, parts=[0] * 60, lengths=[3] * 60, checksums=[0] * 60
        )
        batches.append(encode_bulk(index, [b"abc"] * 60))
    with grpc.insecure_channel(vault.address) as channel:
        put = channel.stream_unary(
            f"/{SERVICE_NAME}/Put", response_deserializer=vault_pb2.PutSummary.FromString
        )
        summary = put(iter(batches), timeout=5)
    assert (summary.stored, summary.rejected) == (0, 180)
    assert len(summary.rejections) == MAX_REPORTED_REJECTIONS
    assert all("checksum" in rejection.reason for rejection in summary.rejections)


def test_generated_stub_interoperates_with_the_fast_codec(vault: Any) -> None:
    """A plain protobuf client (any language) sees an ordinary PromoteChunk stream."""
    payload = b"p" * 5000
    vault.store.put(NS, key(7), 3, payload, block_checksum(NS, key(7), 3, payload))
    from tierkv.wire._pb import vault_pb2_grpc

    with grpc.insecure_channel(vault.address) as channel:
        stub = vault_pb2_grpc.VaultStub(channel)
        request = vault_pb2.PromoteRequest(namespace=NS, keys=[key(6), key(7)], parts=[3])
        [chunk] = list(stub.Promote(request, timeout=5))
        assert list(chunk.index.key_indices) == [1] and chunk.data == payload
        batch = vault_pb2.PutBatch(
            index=vault_pb2.PutIndex(
                namespace=NS,
                keys=[key(8)],
                parts=[0],
                lengths=[3],
                checksums=[block_checksum(NS, key(8), 0, b"abc")],
            ),
            data=b"abc",
        )
        assert stub.Put(iter([batch]), timeout=5).stored == 1
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk-path", "grpc-stream"])
def test_one_gib_promote_arrives_in_bounded_chunks(vault_factory: Callable, bulk: bool) -> None:
    vault = vault_factory(max_bytes="2GiB", bulk=bulk)
    block = MIB
    count = 1024
    data = bytearray(block * count)  # 1 GiB, mostly untouched zero pages; the vault keeps views
    view = memoryview(data)
    keys = [key(i) for i in range(count)]
    for i in range(count):
        data[i * block : i * block + 8] = i.to_bytes(8, "little")  # which block is which
        piece = view[i * block : (i + 1) * block]
        assert vault.store.put(NS, keys[i], 0, piece, block_checksum(NS, keys[i], 0, piece)) is None
    with VaultClient(vault.address, promote_deadline_s=60) as client:
        found = client.promote(NS, keys, [0])
        assert client.checksum_failures == 0  # every payload matched its stored checksum
        assert client.transport == ("bulk" if bulk else "grpc")
    assert len(found) == count
    assert all(found[(i, 0)][:8] == i.to_bytes(8, "little") for i in range(count))
    chunks = {id(payload.obj): len(payload.obj) for payload in found.values()}
    assert len(chunks) >= count * block // CHUNK_BYTES
    assert max(chunks.values()) <= CHUNK_BYTES + 64 * 1024


def test_eight_concurrent_clients_get_back_every_acknowledged_block(vault: Any) -> None:
    errors: list[str] = []

    def worker(w: int) -> None:
        ns = bytes([w]) * 16
        blocks = {
            (i, p): payload_for(w * 100 + i, p, 2000 + 911 * i) for i in range(40) for p in (0, 1)
        }
        with VaultClient(vault.address) as client:
            for (i, p), payload in blocks.items():
                client.put(ns, key(i), p, payload)
            if not client.flush(timeout=30):
                errors.append(f"client {w}: flush failed")
                return
            found = client.promote(ns, [key(i) for i in range(40)], [0, 1])
            if {k: bytes(v) for k, v in found.items()} != blocks:
                errors.append(f"client {w}: blocks differ")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert vault.store.stats().entries == 8 * 80


def test_delete_and_clear(vault: Any) -> None:
    with VaultClient(vault.address) as client:
        for i in range(4):
            client.put(NS, key(i), 0, b"x" * 10)
            client.put(b"o" * 16, key(i), 0, b"y" * 10)
        assert client.flush(timeout=10)
        assert client.delete(NS, [key(0)]) == 1
        assert client.lookup(NS, [key(0)], [0]) == 0
        assert client.clear(NS) == 3
        assert client.stats().entries == 4


def test_management_calls_raise_vault_unavailable_when_down(free_port: int) -> None:
    client = VaultClient(f"127.0.0.1:{free_port}", deadline_s=0.5)
    with client, pytest.raises(BackendUnavailable, match=f"127.0.0.1:{free_port}"):
        client.stats()


def test_second_vault_on_a_taken_port_fails_clearly(vault: Any) -> None:
    with pytest.raises(VaultBindError, match=vault.address):
        serve(vault.address, 0)


def test_bad_role_or_address_is_refused() -> None:
    with pytest.raises(ValueError, match="role"):
        serve("127.0.0.1:0", 0, role="inference")
    with pytest.raises(ValueError, match="port"):
        serve("127.0.0.1:99999", 0)
