"""One tenant cannot slow the others down or lock them out: a real vault of two tenants on
loopback, one of them hostile. The other tenant's latency is measured as a ratio to its own
baseline in the same run (printed with -s for the closing note), never against a fixed time.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from helpers import key

from tierkv.backends.vault import VaultClient
from tierkv.checksum import block_checksum
from tierkv.vault.auth import Tokens
from tierkv.vault.server import VaultServer, serve

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
