"""The client against dead, hung and restarted vaults: misses within deadlines, puts never block."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from helpers import SLOW_BOX_MARGIN_S, key, stop_process, wait_until

from tierkv.backends.vault import VaultClient
from tierkv.config import LimitsConfig
from tierkv.sizes import MIB
from tierkv.vault.server import VaultServicer, serve
from tierkv.wire._pb import vault_pb2

NS = b"n" * 16
KIB = 1024


def test_killed_vault_gives_misses_in_time_and_puts_never_block(vault_factory: Callable) -> None:
    vault: Any = vault_factory(subprocess=True)
    deadline_s = 1.0
    client = VaultClient(
        vault.address,
        deadline_s=deadline_s,
        promote_deadline_s=deadline_s,
        max_pending_bytes=64 * KIB,
        breaker_failures=2,
        breaker_cooldown_s=0.2,
    )
    try:
        for i in range(4):
            client.put(NS, key(i), 0, b"x" * KIB)
        assert client.flush(timeout=10)
        assert client.lookup(NS, [key(i) for i in range(4)], [0]) == 4

        vault.kill()
        for _ in range(3):
            started = time.monotonic()
            assert client.lookup(NS, [key(0)], [0]) == 0
            assert client.promote(NS, [key(0)], [0]) == {}
            assert time.monotonic() - started < 2 * deadline_s + SLOW_BOX_MARGIN_S
        assert client.breaker_state == "open"
        calls_failed = client.failed_calls
        assert client.lookup(NS, [key(0)], [0]) == 0  # open breaker: answered without a call
        assert client.promote(NS, [key(0)], [0]) == {}
        assert client.failed_calls == calls_failed

        slowest = 0.0
        for i in range(500):
            started = time.monotonic()
            client.put(NS, key(i), 0, os.urandom(4 * KIB))
            slowest = max(slowest, time.monotonic() - started)
        assert slowest < deadline_s  # no put ever waits for a call to the vault
        assert client.pending_bytes <= 64 * KIB
        assert client.flush(timeout=5) is False  # puts were lost, and flush says so
        assert client.dropped_puts + client.failed_puts == 500
    finally:
        client.close()


def test_breaker_closes_by_itself_when_the_vault_comes_back(free_port: int) -> None:
    address = f"127.0.0.1:{free_port}"
    client = VaultClient(address, deadline_s=0.5, breaker_failures=2, breaker_cooldown_s=0.1)
    try:
        for _ in range(2):
            assert client.lookup(NS, [key(0)], [0]) == 0
        assert client.breaker_state == "open"
        server = serve(address, 0)
        try:
            assert wait_until(lambda: client.breaker_state == "closed", timeout=10)
            client.put(NS, key(0), 0, b"back")
            assert client.flush(timeout=5)
            assert client.lookup(NS, [key(0)], [0]) == 1
        finally:
            server.stop(grace=0)
    finally:
        client.close()


def test_hung_vault_costs_one_deadline_and_the_queue_drops_the_oldest(
    vault_factory: Callable,
) -> None:
    vault: Any = vault_factory(subprocess=True)
    assert vault.process is not None
    client = VaultClient(vault.address, deadline_s=1.0, max_pending_bytes=10 * KIB)
    try:
        client.put(NS, key(100), 0, b"warm")
        assert client.flush(timeout=10)
        stop_process(vault.process.pid)
        try:
            # Each call gives up after its 1 s deadline (the promote's whole-call deadline is
            # 30 s: its stall guard ends it), never much later even on a loaded box.
            started = time.monotonic()
            assert client.lookup(NS, [key(100)], [0]) == 0
            assert 0.9 < time.monotonic() - started < 1.0 + SLOW_BOX_MARGIN_S
            started = time.monotonic()
            assert client.promote(NS, [key(100)], [0]) == {}
            assert 0.9 < time.monotonic() - started < 1.0 + SLOW_BOX_MARGIN_S
            client.put(NS, key(99), 0, b"k" * KIB)  # the sender takes it and hangs
            assert wait_until(lambda: client.in_flight_puts == 1, timeout=1)
            for i in range(20):
                client.put(NS, key(i), 0, bytes([i]) * KIB)
            assert client.pending_bytes == 10 * KIB  # 1 KiB on its way + the 9 newest
            assert client.dropped_puts == 11
        finally:
            os.kill(vault.process.pid, signal.SIGCONT)
        assert client.flush(timeout=10) is False  # eleven were dropped
        present = [i for i in range(20) if client.lookup(NS, [key(i)], [0]) == 1]
        assert present == list(range(11, 20))
    finally:
        client.close()


def test_a_stopped_vault_answers_nothing(vault_factory: Callable) -> None:
    """Regression: SIGSTOP only queues the stop, and a vault's other threads answered lookups
    until each took it, so a "hung" vault gave a lookup hit in a CI run. stop_process waits."""
    vault: Any = vault_factory(subprocess=True)
    client = VaultClient(vault.address, deadline_s=0.2, breaker_failures=1_000_000)
    try:
        client.put(NS, key(1), 0, b"present")
        assert client.flush(timeout=10)
        for _ in range(30):
            stop_process(vault.process.pid)
            try:
                assert client.lookup(NS, [key(1)], [0]) == 0
            finally:
                os.kill(vault.process.pid, signal.SIGCONT)
            assert wait_until(lambda: client.lookup(NS, [key(1)], [0]) == 1, timeout=10)
    finally:
        client.close()


def test_every_put_is_accounted_for(vault_factory: Callable) -> None:
    vault = vault_factory(max_bytes=5000)
    with VaultClient(vault.address, max_pending_bytes=4000) as client:
        client.put(NS, key(0), 0, b"x" * 4001)  # larger than the queue: dropped at once
        client.put(NS, key(1), 0, b"x" * 3000)
        client.put(NS, key(2), 0, b"x" * 10)
        assert client.flush(timeout=5) is False
        assert client.dropped_puts == 1
        assert client.stored_puts + client.rejected_puts + client.dropped_puts == 3
        assert client.flush(timeout=5) is True  # nothing lost since the last flush


@pytest.mark.parametrize("bulk", [True, False])
def test_many_tiny_puts_get_time_for_their_count_not_only_their_bytes(
    vault_factory: Callable, bulk: bool
) -> None:
    """200,000 16-byte puts: about 3 s of the vault's work on an idle box but under 7 MB, so a
    deadline of deadline_s plus bytes alone (1.13 s) failed them all (the lost puts of the
    spread tests of test_backends.py on a loaded box). A 1 s deadline, not a tighter one: in the
    whole suite's process (gigabytes of heap, threads of earlier tests) the client itself
    stalls, and with 0.3 s a frame of a few thousand puts failed in two clean-clone CI runs."""
    vault = vault_factory(bulk=bulk, subprocess=bulk)
    with VaultClient(vault.address, deadline_s=1.0) as client:
        assert client.wait_ready(10)
        for i in range(200_000):
            client.put(NS, key(i), 0, i.to_bytes(16, "little"))
        assert client.flush(timeout=120), client.counters()
        assert client.stored_puts == 200_000
        assert client.transport == ("bulk" if bulk else "grpc")


def test_client_rejects_a_malformed_address() -> None:
    with pytest.raises(ValueError, match="brackets"):
        VaultClient("::1:50051")


@pytest.mark.parametrize("bulk_port", [0, None], ids=["bulk", "grpc"])
def test_oversized_blocks_are_the_callers_error_and_leave_the_breaker_closed(
    bulk_port: int | None,
) -> None:
    """Regression: a block larger than the vault takes (a bulk frame, a gRPC message) failed its
    stream twice (bulk, then gRPC), so two such puts opened the breaker and the next good Promote
    and small Put were misses. Now it is refused before it is sent, counted, breaker untouched."""
    limits = LimitsConfig(max_message_bytes=MIB, max_inflight_bytes=MIB)
    server = serve("127.0.0.1:0", 0, bulk_port=bulk_port, limits=limits)
    client = VaultClient(server.address, breaker_failures=2, breaker_cooldown_s=3600)
    try:
        client.put(NS, key(0), 0, b"kept")
        assert client.flush(timeout=10)
        for i in range(1, 4):
            client.put(NS, key(i), 0, bytes([i]) * (2 * MIB))
            client.flush(timeout=10)
        assert client.breaker_state == "closed" and client.failed_calls == 0
        assert client.counters()["oversized_puts"] == 3
        assert client.rejected_puts == 3 and client.failed_puts == 0
        assert "exceeds" in client.last_rejections[0]
        assert bytes(client.promote(NS, [key(0)], [0])[(0, 0)]) == b"kept"
        assert_a_small_put_comes_back(client)
    finally:
        client.close()
        server.stop(grace=0)


def assert_a_small_put_comes_back(client: VaultClient) -> None:
    client.put(NS, key(9), 0, b"small")
    assert client.flush(timeout=10)
    assert bytes(client.promote(NS, [key(9)], [0])[(0, 0)]) == b"small"


def test_a_vault_that_does_not_tell_its_largest_put_still_leaves_the_breaker_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vault that predates Hello's limits answers a too-large gRPC message RESOURCE_EXHAUSTED
    "larger than max": the caller's error too, counted, not a failure of the vault."""

    def older_hello(self: VaultServicer, request: Any, context: Any) -> vault_pb2.HelloReply:
        return vault_pb2.HelloReply(bulk_port=self.bulk_port)

    monkeypatch.setattr(VaultServicer, "Hello", older_hello)
    server = serve("127.0.0.1:0", 0, bulk_port=None, limits=LimitsConfig(max_message_bytes=MIB))
    client = VaultClient(server.address, breaker_failures=2, breaker_cooldown_s=3600)
    try:
        for i in range(3):
            client.put(NS, key(i), 0, bytes([i]) * (2 * MIB))
            assert client.flush(timeout=10) is False  # lost, and flush says so
        assert client.breaker_state == "closed" and client.failed_calls == 0
        assert client.counters()["oversized_puts"] == 3
        assert_a_small_put_comes_back(client)
    finally:
        client.close()
        server.stop(grace=0)
