"""One tenant cannot slow the others down or lock them out: a real vault of two tenants on
loopback, one of them hostile. The other tenant's latency is measured as a ratio to its own
baseline in the same run (printed with -s for the closing note), never against a fixed time.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import grpc
import pytest
from helpers import key, wait_until

from tierkv.backends.base import BackendUnavailable
from tierkv.backends.security import proving_channel
from tierkv.backends.vault import VaultClient, VaultRefused
from tierkv.checksum import block_checksum
from tierkv.config import LimitsConfig
from tierkv.vault.auth import ReplayGuard, Tokens
from tierkv.vault.limits import ByteBudget
from tierkv.vault.server import VaultServer, serve
from tierkv.wire._pb import vault_pb2
from tierkv.wire.proofs import CALL_NONCE_BYTES

ALICE = "alice-token-0123456789abcdef"
MALLORY = "mallory-token-0123456789abcd"
NS = b"alice-namespace0"
NAMESPACES = 150_000
"""Namespaces the hostile tenant holds (one block each); a scan of them costs tens of ms."""
LOOPS = 3
"""Processes looping on the hostile tenant's calls."""
SAMPLES = 25


@pytest.fixture
def two_tenants() -> Iterator[VaultServer]:
    server = serve("127.0.0.1:0", 0, tokens=Tokens([("alice", ALICE), ("mallory", MALLORY)]))
    yield server
    server.stop(grace=None)


def _medians_ms(address: str) -> tuple[float, float]:
    """Alice's put (acknowledged) and promote medians over SAMPLES calls, in ms."""
    puts, promotes = [], []
    with VaultClient(address, token=ALICE, deadline_s=30, promote_deadline_s=30) as client:
        for i in range(SAMPLES):
            started = time.perf_counter()
            client.put(NS, key(i), 0, b"alice %d" % i * 100)
            assert client.flush(timeout=30)
            puts.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert client.promote(NS, [key(i)], [0])
            promotes.append(time.perf_counter() - started)
    return statistics.median(puts) * 1e3, statistics.median(promotes) * 1e3


def _looping(address: str, call: str) -> subprocess.Popen[str]:
    """A process calling Mallory's `call` on the vault in a loop until killed; ready once it
    prints "looping"."""
    code = f"""
from tierkv.backends.vault import VaultClient
with VaultClient({address!r}, token={MALLORY!r}, deadline_s=30) as client:
    client.{call}
    print("looping", flush=True)
    while True:
        client.{call}
"""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "looping"
    return process


def _during(address: str, hostile: Callable[[], subprocess.Popen[str]]) -> tuple[float, float]:
    """Alice's medians while LOOPS processes run `hostile`."""
    processes = []
    try:
        for _ in range(LOOPS):
            processes.append(hostile())
        return _medians_ms(address)
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=30)


def test_stats_of_a_tenant_with_many_namespaces_leaves_the_others_calls_alone(
    two_tenants: VaultServer,
) -> None:
    """Mallory holds NAMESPACES namespaces and loops on Stats: Stats comes from per-tenant
    counters, so it holds the store lock as briefly however many she has (a scan of them under
    the lock took Alice's put and promote medians from about 1 ms to tens of ms)."""
    store = two_tenants.store
    for i in range(NAMESPACES):
        namespace = b"mallory/%016d" % i
        payload = b"m"
        checksum = block_checksum(namespace, key(0), 0, payload)
        assert store.put(namespace, key(0), 0, payload, checksum) is None
    address = two_tenants.address
    with VaultClient(address, token=MALLORY) as mallory:
        assert mallory.stats().entries == NAMESPACES
    put_before, promote_before = _medians_ms(address)
    put_during, promote_during = _during(address, lambda: _looping(address, "stats()"))
    print(
        f"\nStats loop over {NAMESPACES} namespaces: Alice's put median {put_before:.2f} -> "
        f"{put_during:.2f} ms ({put_during / put_before:.1f}x), promote {promote_before:.2f} -> "
        f"{promote_during:.2f} ms ({promote_during / promote_before:.1f}x)"
    )
    assert put_during < 10 * put_before + 5  # (a scan: 0.2 -> 260 ms on a loaded 2-core box)
    assert promote_during < 10 * promote_before + 5


def test_a_tenant_at_its_remembered_proofs_bound_leaves_the_others_calls_alone() -> None:
    """Each tenant has its own bound of remembered proofs: one filling it has its own calls
    refused, never another tenant's (one shared set refused every tenant for minutes)."""
    tokens = Tokens([("alice", ALICE), ("mallory", MALLORY)], remembered_proofs=20)
    server = serve("127.0.0.1:0", 0, tokens=tokens)
    try:
        with VaultClient(server.address, token=MALLORY) as mallory:
            for _ in range(20):
                mallory.stats()
            with pytest.raises(VaultRefused, match="more than 20 calls"):
                mallory.stats()
        with VaultClient(server.address, token=ALICE) as alice:
            assert alice.stats().tenant == "alice"
    finally:
        server.stop(grace=None)


def test_a_remembered_proof_costs_less_than_a_hundred_bytes() -> None:
    guard = ReplayGuard(limit=200_000)
    now = time.time()
    nonces = [os.urandom(CALL_NONCE_BYTES).hex() for _ in range(100_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for nonce in nonces:
            assert guard.admit(nonce, now) is None
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / len(nonces)
    finally:
        tracemalloc.stop()
    print(f"\nremembered call proof: {per_entry:.0f} bytes each")
    assert per_entry < 100
    assert guard.admit(nonces[0], now) == "tierkv call proof replayed"


def _put_stream(channel: grpc.Channel, token: str) -> grpc.StreamUnaryMultiCallable:
    return proving_channel(channel, token).stream_unary(
        "/tierkv.v1.Vault/Put",
        request_serializer=bytes,
        response_deserializer=vault_pb2.PutSummary.FromString,
    )


def _refused(put: grpc.StreamUnaryMultiCallable) -> bool:
    """Whether an empty Put stream is refused for a limit (RESOURCE_EXHAUSTED)."""
    try:
        put(iter(()), timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        return True
    return False


def _vault_of_two_tenants(calls_per_tenant: int) -> VaultServer:
    """Alice's and Mallory's vault serving 16 calls at once, `calls_per_tenant` of one tenant's."""
    limits = LimitsConfig(max_concurrent_rpcs=16, max_concurrent_rpcs_per_tenant=calls_per_tenant)
    return serve(
        "127.0.0.1:0", 0, tokens=Tokens([("alice", ALICE), ("mallory", MALLORY)]), limits=limits
    )


def _sending_nothing_until(release: threading.Event) -> Callable[[], Iterator[bytes]]:
    """A Put stream's requests: none, the stream left open until `release` is set (60 s at most)."""

    def nothing_until_released() -> Iterator[bytes]:
        release.wait(60)
        yield from ()

    return nothing_until_released


def test_a_tenant_holding_its_streams_leaves_the_others_theirs() -> None:
    """Mallory holds her share of Put streams (streams that send nothing): her next one is
    refused, naming her share, and Alice's calls and streams are served. (One tenant could hold
    every stream slot of the vault, and with them every byte it receives at once.)"""
    server = _vault_of_two_tenants(calls_per_tenant=4)
    release = threading.Event()
    nothing_until_released = _sending_nothing_until(release)

    try:
        with grpc.insecure_channel(server.address) as plain:
            put = _put_stream(plain, MALLORY)
            held = [put.future(nothing_until_released(), timeout=60) for _ in range(2)]

            def refused_naming_her_share() -> bool:
                try:
                    put(iter(()), timeout=10)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    assert "streams of tenant mallory" in str(exc.details()), exc
                    return True
                return False

            assert wait_until(refused_naming_her_share, 20)
            assert not _refused(_put_stream(plain, ALICE))
            with VaultClient(server.address, token=ALICE) as alice:
                for _ in range(8):
                    assert alice.stats().tenant == "alice"
            release.set()
            for call in held:
                call.result(timeout=30)
    finally:
        release.set()
        server.stop(grace=None)


FLOOD_CHANNELS = 8
FLOOD_THREADS = 16
"""Mallory's flood: calls kept in flight on each of FLOOD_CHANNELS connections (128 in all)."""


def _flooding(address: str) -> subprocess.Popen[str]:
    """A process keeping FLOOD_CHANNELS * FLOOD_THREADS of Mallory's Hello calls in flight, each
    sent again the moment it is answered or refused; ready once it prints "flooding"."""
    code = f"""
import threading, grpc
from tierkv.backends.security import proving_channel
from tierkv.wire._pb import vault_pb2
channels = [grpc.insecure_channel({address!r}) for _ in range({FLOOD_CHANNELS})]
def hello(channel):
    call = proving_channel(channel, {MALLORY!r}).unary_unary(
        "/tierkv.v1.Vault/Hello",
        request_serializer=vault_pb2.HelloRequest.SerializeToString,
        response_deserializer=vault_pb2.HelloReply.FromString,
    )
    while True:
        try:
            call(vault_pb2.HelloRequest(), timeout=30)
        except grpc.RpcError:
            pass
for channel in channels:
    for _ in range({FLOOD_THREADS}):
        threading.Thread(target=hello, args=(channel,), daemon=True).start()
print("flooding", flush=True)
threading.Event().wait()
"""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "flooding"
    return process


def _stats_medians_ms(address: str, calls: int) -> tuple[float, int]:
    """Alice's Stats median over `calls` calls, in ms, and how many were refused."""
    times, refused = [], 0
    with VaultClient(address, token=ALICE, deadline_s=30) as alice:
        for _ in range(calls):
            started = time.perf_counter()
            try:
                alice.stats()
            except BackendUnavailable:
                refused += 1
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3, refused


def test_a_tenant_flooding_calls_gets_none_of_the_others_refused() -> None:
    """Mallory holds every Put stream she may and keeps 128 more calls in flight over eight
    connections: her calls past her share are refused, never Alice's. (gRPC's own concurrent-call
    limit, shared by every tenant, refused Alice's calls before tierkv's per-tenant limit counted
    them, and one tenant could hold every Put/Promote stream slot of the vault.)"""
    server = _vault_of_two_tenants(calls_per_tenant=8)
    release = threading.Event()
    nothing_until_released = _sending_nothing_until(release)

    flood = None
    try:
        baseline, _ = _stats_medians_ms(server.address, 30)
        with grpc.insecure_channel(server.address) as plain:
            mallorys_put = _put_stream(plain, MALLORY)
            held = [mallorys_put.future(nothing_until_released(), timeout=60) for _ in range(8)]
            assert wait_until(lambda: _refused(mallorys_put), 20)
            assert not _refused(_put_stream(plain, ALICE))
            flood = _flooding(server.address)
            during, refused = _stats_medians_ms(server.address, 60)
            print(
                f"\n128 of Mallory's calls in flight: Alice's Stats median {baseline:.2f} -> "
                f"{during:.2f} ms ({during / baseline:.1f}x), {refused} of 60 refused"
            )
            assert refused == 0
            assert not _refused(_put_stream(plain, ALICE))
            release.set()
            for call in held:
                try:
                    call.result(timeout=30)
                except grpc.RpcError as exc:  # her streams past her share
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
    finally:
        release.set()
        if flood is not None:
            flood.kill()
            flood.wait(timeout=30)
        server.stop(grace=None)


def test_a_byte_budget_keeps_each_holders_share() -> None:
    """One holder gets at most its share while it holds anything (one item larger than the share
    fits alone), and what it leaves stays for the others."""
    budget = ByteBudget(100, per_holder=50)
    assert budget.acquire(40, 0, "mallory")
    assert not budget.acquire(20, 0, "mallory")  # past her share
    assert budget.acquire(40, 0, "alice")
    budget.release(40, "mallory")
    assert budget.acquire(60, 0, "mallory")  # larger than a share, alone: fits
    assert not budget.acquire(10, 0, "mallory")
    assert not budget.acquire(1, 0, "alice")  # the whole budget is held
    budget.release(60, "mallory")
    budget.release(40, "alice")
    assert budget.acquire(100, 0, "alice")
