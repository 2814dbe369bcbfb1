"""Random and mutated gRPC messages and bulk frames against a real `tierkv vault` process.

Bounded in time (a few hundred examples, well under a minute): whatever arrives, the vault
never dies, never stores a block that does not match its checksum or is empty, and a normal
client still works afterwards.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.backends.vault import VaultClient
from tierkv.checksum import block_checksum
from tierkv.wire._pb import vault_pb2
from tierkv.wire.framing import AUTH, CHALLENGE, HEADER, MAGIC
from tierkv.wire.messages import encode_bulk

NAMESPACES = [b"fuzz-ns-00000000", b"fuzz-ns-11111111"]
KEYS = [bytes([i]) * 16 for i in range(4)]
METHODS = ["Put", "Lookup", "Promote", "Stats", "Delete", "Clear", "Hello"]
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
"""How the vault answers a malformed request, or one past its limits."""
FUZZ_LIMITS = """
[limits]
handshake_timeout_s = 1.0
stall_timeout_s = 1.0
max_message_bytes = "1MiB"
max_inflight_bytes = "8MiB"
"""
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def fuzzed_vault(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from helpers import VaultHandle, pick_free_port, start_subprocess_vault, wait_serving

    port = pick_free_port()
    process, log_path = start_subprocess_vault(
        port, "64MiB", "kv_cold", tmp_path_factory.mktemp("fuzz"), config_text=FUZZ_LIMITS
    )
    handle = VaultHandle(f"127.0.0.1:{port}", port, process=process, log_path=log_path)
    try:
        wait_serving(handle.address, process)
        with VaultClient(handle.address) as client:
            handle.bulk_port = client.bulk_path()[0]  # type: ignore[attr-defined]
        yield handle
    finally:
        handle.stop()


def valid_put_batch(namespace: bytes, key: bytes, part: int, payload: bytes) -> bytes:
    index = vault_pb2.PutIndex(
        namespace=namespace,
        keys=[key],
        parts=[part],
        lengths=[len(payload)],
        checksums=[block_checksum(namespace, key, part, payload)],
    )
    return encode_bulk(index, [payload])


blocks = st.tuples(
    st.sampled_from(NAMESPACES),
    st.sampled_from(KEYS),
    st.integers(0, 3),
    st.binary(min_size=0, max_size=64),
)


def mutated(raw: bytes, flips: list[tuple[int, int]], cut: int | None) -> bytes:
    data = bytearray(raw)
    for position, value in flips:
        if data:
            data[position % len(data)] = value
    return bytes(data[:cut] if cut is not None else data)


mutations = st.tuples(
    st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6),
    st.none() | st.integers(0, 200),
)


@SETTINGS
@given(
    method=st.sampled_from(METHODS),
    block=blocks,
    mutation=mutations,
    garbage=st.none() | st.binary(max_size=300),
)
def test_random_and_mutated_grpc_messages(
    fuzzed_vault: Any,
    method: str,
    block: tuple[bytes, bytes, int, bytes],
    mutation: tuple[list[tuple[int, int]], int | None],
    garbage: bytes | None,
) -> None:
    """Each message is answered: done, or refused as malformed or over a limit, never an
    exception in the vault (UNKNOWN, INTERNAL), a hang (DEADLINE_EXCEEDED) or a dead vault."""
    message = garbage if garbage is not None else mutated(valid_put_batch(*block), *mutation)
    with grpc.insecure_channel(fuzzed_vault.address) as channel:
        identity: Callable[[bytes], bytes] = lambda raw: raw  # noqa: E731
        path = f"/tierkv.v1.Vault/{method}"
        try:
            if method == "Put":
                channel.stream_unary(path, identity, identity)(iter([message]), timeout=5)
            elif method == "Promote":
                list(channel.unary_stream(path, identity, identity)(message, timeout=5))
            else:
                channel.unary_unary(path, identity, identity)(message, timeout=5)
        except grpc.RpcError as error:
            assert error.code() in REFUSALS, (method, message, error)
    assert fuzzed_vault.process.poll() is None, "the vault died"


def _frame(kind: int, index: bytes, data: bytes) -> bytes:
    return HEADER.pack(MAGIC, kind, len(index), len(data)) + index + data


@SETTINGS
@given(
    kind=st.integers(0, 9),
    block=blocks,
    mutation=mutations,
    header=st.none() | st.binary(min_size=HEADER.size, max_size=HEADER.size),
    authenticate=st.booleans(),
)
def test_random_and_mutated_bulk_frames(
    fuzzed_vault: Any,
    kind: int,
    block: tuple[bytes, bytes, int, bytes],
    mutation: tuple[list[tuple[int, int]], int | None],
    header: bytes | None,
    authenticate: bool,
) -> None:
    namespace, key, part, payload = block
    index = vault_pb2.PutIndex(
        namespace=namespace,
        keys=[key],
        parts=[part],
        lengths=[len(payload)],
        checksums=[block_checksum(namespace, key, part, payload)],
    ).SerializeToString()
    frame = mutated(_frame(kind, index, payload), *mutation)
    if header is not None:
        frame = header + frame[HEADER.size :]
    address = ("127.0.0.1", fuzzed_vault.bulk_port)
    with socket.create_connection(address, timeout=5) as sock, contextlib.suppress(OSError):
        head = sock.recv(HEADER.size, socket.MSG_WAITALL)
        assert HEADER.unpack(head)[1] == CHALLENGE
        sock.recv(HEADER.unpack(head)[2], socket.MSG_WAITALL)
        if authenticate:
            sock.sendall(_frame(AUTH, b"", b""))
            sock.recv(HEADER.size, socket.MSG_WAITALL)  # WELCOME
        sock.sendall(frame)
        sock.settimeout(2)
        sock.recv(1 << 16)


def test_after_the_fuzzing_the_vault_serves_and_holds_only_intact_blocks(
    fuzzed_vault: Any,
) -> None:
    assert fuzzed_vault.process.poll() is None, "the vault died"
    with VaultClient(fuzzed_vault.address) as client:
        for namespace in NAMESPACES:
            found = client.promote(namespace, KEYS, [0, 1, 2, 3])
            assert all(len(payload) > 0 for payload in found.values())
        assert client.checksum_failures == 0  # nothing stored that does not match
        client.put(NAMESPACES[0], b"n" * 16, 0, b"normal")
        assert client.flush(timeout=10)
        assert client.promote(NAMESPACES[0], [b"n" * 16], [0]) == {(0, 0): b"normal"}
