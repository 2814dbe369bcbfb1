"""Backends against real servers on loopback: several vaults spread by weight (one killed),
Valkey / Redis single and cluster (one node killed), deadlines and checksums."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash
from helpers import VaultHandle, stop_process

from tests.redis_servers import RedisServer, start_cluster, start_redis
from tests.tls_certs import make_certs
from tierkv.backends import open_backend, open_one
from tierkv.backends.base import Backend
from tierkv.backends.redis import RedisBackend, RedisClusterBackend, redis_key
from tierkv.backends.sharded import WeightedShards
from tierkv.backends.vault import VaultClient
from tierkv.config import ClientConfig, Endpoint, SecurityConfig

NS = b"test-namespace!!"
PARTS = [0, 1]
SPREAD_BLOCKS = 10_000
DEADLINE_S = 1.0
DEADLINE_MARGIN_S = 0.5
"""How far past its deadline a call on a dead or stalled server may return."""
FAST = ClientConfig(deadline_ms=int(DEADLINE_S * 1000), promote_deadline_ms=10_000)


def block_keys(count: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(count)]


def payload(index: int, part: int, size: int = 16) -> bytes:
    return (index * 4 + part).to_bytes(8, "little") * (size // 8)


def put_all(backend: Backend, keys: list[bytes], size: int = 16) -> None:
    """Store every block; a put lost on a loaded box (flush says so) is stored again, up to
    three times: these tests are about where blocks are and what reads return, not delivery."""
    for _ in range(3):
        for index, key in enumerate(keys):
            for part in PARTS:
                backend.put(NS, key, part, payload(index, part, size))
        if backend.flush(timeout=120):
            return
    pytest.fail(f"puts were lost three times: {backend.counters()}")


def assert_payloads(found: dict[tuple[int, int], memoryview], size: int = 16) -> None:
    for (index, part), data in found.items():
        assert bytes(data) == payload(index, part, size)


def timed(call: Callable[[], object]) -> tuple[object, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


# ---- several vaults -------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 2.0, 3.0)])
def test_blocks_spread_over_vaults_in_proportion_to_weight(
    vault_factory: Callable[..., VaultHandle], weights: tuple[float, ...]
) -> None:
    vaults = [vault_factory() for _ in weights]
    members = [VaultClient(v.address) for v in vaults]
    shards = WeightedShards(list(zip(members, weights, strict=True)))
    keys = block_keys(SPREAD_BLOCKS)
    try:
        put_all(shards, keys)
        holders: dict[int, int] = {}
        for number, member in enumerate(members):
            found = member.promote(NS, keys, PARTS)
            blocks = {index for index, _ in found}
            assert set(found) == {(i, p) for i in blocks for p in PARTS}  # every part together
            expected = SPREAD_BLOCKS * weights[number] / sum(weights)
            assert abs(len(blocks) - expected) <= 0.1 * expected, (len(blocks), expected)
            for index in blocks:
                assert holders.setdefault(index, number) == number  # one vault per block
        assert len(holders) == SPREAD_BLOCKS
        assert shards.lookup(NS, keys, PARTS) == SPREAD_BLOCKS
        found = shards.promote(NS, keys, PARTS)
        assert len(found) == SPREAD_BLOCKS * len(PARTS)
        assert_payloads(found)
        rows = shards.server_stats()
        assert sum(row.entries for row in rows) == SPREAD_BLOCKS * len(PARTS)
    finally:
        shards.close()


def test_shards_receive_payloads_into_the_buffers_given_by_the_callers_key_index(
    vault_factory: Callable[..., VaultHandle],
) -> None:
    members = [VaultClient(vault_factory().address) for _ in range(2)]
    shards = WeightedShards([(member, 1.0) for member in members])
    keys = block_keys(200)
    buffers = {(i, p): bytearray(16) for i in range(len(keys)) for p in PARTS}
    try:
        put_all(shards, keys)

        def into(indices, parts):
            return {(i, p): [memoryview(buffers[i, p])] for i in indices for p in parts}

        found = shards.promote(NS, keys, PARTS, into)
        assert len(found) == len(buffers)
        assert all(found[block].obj is buffers[block] for block in buffers)
        assert_payloads(found)
    finally:
        shards.close()


def test_adding_a_vault_moves_only_its_share(vault_factory: Callable[..., VaultHandle]) -> None:
    a, b, c = (VaultClient(vault_factory().address) for _ in range(3))
    keys = block_keys(2000)
    two = WeightedShards([(a, 1.0), (b, 1.0)])
    three = WeightedShards([(a, 1.0), (b, 1.0), (c, 1.0)])
    moved = [key for key in keys if two.owner(key) is not three.owner(key)]
    assert all(three.owner(key) is c for key in moved)
    assert abs(len(moved) - len(keys) / 3) <= 0.1 * len(keys) / 3
    three.close()


def test_a_killed_vault_costs_only_its_share(vault_factory: Callable[..., VaultHandle]) -> None:
    vaults = [vault_factory(subprocess=True) for _ in range(3)]
    shards = open_backend([Endpoint(v.address) for v in vaults], FAST)
    assert isinstance(shards, WeightedShards)
    keys = block_keys(3000)
    try:
        put_all(shards, keys)
        dead = shards.members()[1]
        vaults[1].kill()
        lost = {i for i, key in enumerate(keys) if shards.owner(key) is dead}
        for _ in range(5):  # before and after the dead vault's breaker opens
            found, took = timed(lambda: shards.promote(NS, keys, PARTS))
            assert isinstance(found, dict)
            assert took < DEADLINE_S + DEADLINE_MARGIN_S
            assert {index for index, _ in found} == set(range(len(keys))) - lost
            assert_payloads(found)
            hit, took = timed(lambda: shards.lookup(NS, keys, PARTS))
            assert hit == min(lost) and took < DEADLINE_S + DEADLINE_MARGIN_S
        assert shards.counters()["breaker"] == "1/3 open"
    finally:
        shards.close()


# ---- Valkey / Redis --------------------------------------------------------------------------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[list[RedisServer]]:
    servers = start_cluster(tmp_path)
    yield servers
    for server in servers:
        server.stop()


def test_redis_round_trip_with_the_vault_checksums(redis_server: RedisServer) -> None:
    backend = open_one(f"redis://{redis_server.address}/0", FAST)
    assert isinstance(backend, RedisBackend)
    keys = block_keys(300)
    try:
        put_all(backend, keys, size=64 * 1024)
        assert backend.lookup(NS, keys, PARTS) == len(keys)
        assert backend.lookup(NS, [*keys[:5], b"absent", *keys[5:]], PARTS) == 5
        found = backend.promote(NS, keys, PARTS)
        assert len(found) == len(keys) * len(PARTS)
        assert_payloads(found, size=64 * 1024)
        # A value filed under another block's key fails its address-seeded checksum: a miss.
        raw = redis_server.client()
        raw.copy(redis_key(NS, keys[0], 0), redis_key(NS, keys[1], 0), replace=True)
        found = backend.promote(NS, keys[:2], PARTS)
        assert set(found) == {(0, 0), (0, 1), (1, 1)}
        assert backend.counters()["checksum_failures"] == 1
        [row] = backend.server_stats()
        # ... and the value that failed is removed, so a Lookup no longer counts it
        assert row.entries == len(keys) * len(PARTS) - 1 and row.role == "redis standalone"
        assert backend.lookup(NS, keys[:2], PARTS) == 1
    finally:
        backend.close()


def test_a_damaged_redis_value_is_a_lookup_miss_as_it_is_a_promote_miss(
    redis_server: RedisServer,
) -> None:
    """Regression: Lookup counted any value as present (EXISTS), so a damaged one was a Lookup
    hit and then, every time, a Promote miss (a load planned, failed and recomputed)."""
    backend = open_one(f"redis://{redis_server.address}", FAST)
    keys = block_keys(4)
    try:
        put_all(backend, keys)
        raw = redis_server.client()
        raw.set(redis_key(NS, keys[1], 0), b"short")  # too short to hold its checksum
        assert backend.lookup(NS, keys, PARTS) == 1
        assert (1, 0) not in backend.promote(NS, keys, PARTS)
        raw.setrange(redis_key(NS, keys[2], 1), 8, b"\xee")  # a payload byte changed
        assert backend.lookup(NS, keys[2:], PARTS) == 2  # only a read of it can tell
        assert set(backend.promote(NS, keys[2:], PARTS)) == {(0, 0), (1, 0), (1, 1)}
        assert backend.lookup(NS, keys[2:], PARTS) == 0  # as the Promote found it
        assert raw.exists(redis_key(NS, keys[2], 1)) == 0  # dropped, not read again
        assert backend.counters()["checksum_failures"] == 2
        backend.put(NS, keys[2], 1, payload(2, 1))  # stored again: whole once more
        assert backend.flush(timeout=10)
        assert backend.lookup(NS, keys[2:], PARTS) == 2
        assert bytes(backend.promote(NS, keys[2:3], [1])[(0, 1)]) == payload(2, 1)
    finally:
        backend.close()


def test_redis_password_from_the_environment_never_in_the_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_redis(tmp_path, "--requirepass", "s3cret-pw")
    try:
        keys = block_keys(3)
        refused = open_one(f"redis://{server.address}", FAST)
        refused.put(NS, keys[0], 0, b"x")
        assert not refused.flush(timeout=30) and refused.lookup(NS, keys, PARTS) == 0
        refused.close()
        monkeypatch.setenv("TIERKV_REDIS_PASSWORD", "s3cret-pw")
        backend = open_one(f"redis://{server.address}", FAST)
        put_all(backend, keys)
        assert backend.lookup(NS, keys, PARTS) == 3
        backend.close()
        in_url = open_one(f"redis://:s3cret-pw@{server.address}", FAST)
        assert "s3cret" not in in_url.address and in_url.lookup(NS, keys, PARTS) == 3
        in_url.close()
    finally:
        server.stop()


def test_a_stalled_redis_is_a_miss_within_the_deadline(redis_server: RedisServer) -> None:
    backend = open_one(f"redis://{redis_server.address}", FAST)
    keys = block_keys(10)
    put_all(backend, keys)
    stop_process(redis_server.process.pid)
    try:
        for call in (
            lambda: backend.lookup(NS, keys, PARTS),
            lambda: backend.promote(NS, keys, PARTS),
        ):
            result, took = timed(call)
            assert not result and took < DEADLINE_S + DEADLINE_MARGIN_S
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
        backend.close()


def test_redis_cluster_round_trip_over_every_node(redis_cluster: list[RedisServer]) -> None:
    backend = open_one(f"redis+cluster://{redis_cluster[0].address}", FAST)
    assert isinstance(backend, RedisClusterBackend)
    keys = block_keys(600)
    try:
        put_all(backend, keys, size=4096)
        rows = backend.server_stats()
        assert len(rows) == 3 and all(row.entries > 0 for row in rows)
        assert sum(row.entries for row in rows) == len(keys) * len(PARTS)
        assert backend.lookup(NS, keys, PARTS) == len(keys)
        found = backend.promote(NS, keys, PARTS)
        assert len(found) == len(keys) * len(PARTS)
        assert_payloads(found, size=4096)
        assert backend.clear(NS) == len(keys) * len(PARTS)
        assert backend.lookup(NS, keys, PARTS) == 0
    finally:
        backend.close()


def test_a_killed_cluster_node_means_misses_never_errors(redis_cluster: list[RedisServer]) -> None:
    backend = open_one(f"redis+cluster://{redis_cluster[0].address}", FAST)
    assert isinstance(backend, RedisClusterBackend)
    keys = block_keys(600)
    try:
        put_all(backend, keys)
        redis_cluster[2].kill()
        dead_port = redis_cluster[2].port
        lost = {
            i for i, key in enumerate(keys) if backend.owner(key).address.endswith(f":{dead_port}")
        }
        assert 0 < len(lost) < len(keys)
        for _ in range(5):
            found, took = timed(lambda: backend.promote(NS, keys, PARTS))
            assert isinstance(found, dict) and took < DEADLINE_S + DEADLINE_MARGIN_S
            assert_payloads(found)
            assert {index for index, _ in found} == set(range(len(keys))) - lost
            hit, took = timed(lambda: backend.lookup(NS, keys, PARTS))
            assert hit == min(lost) and took < DEADLINE_S + DEADLINE_MARGIN_S
        backend.put(NS, b"new-key", 0, b"payload")  # never raises, even for the dead node's slot
    finally:
        backend.close()


def test_rediss_verifies_the_server_against_the_configured_ca(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    server = start_redis(tmp_path, certs=certs)
    keys = block_keys(20)
    try:
        trusted = open_one(f"rediss://{server.address}", FAST, SecurityConfig(tls_ca=str(certs.ca)))
        put_all(trusted, keys)
        assert trusted.lookup(NS, keys, PARTS) == len(keys)
        assert_payloads(trusted.promote(NS, keys, PARTS))
        trusted.close()
        unknown_ca = open_one(f"rediss://{server.address}", FAST)  # the system's CAs only
        assert unknown_ca.lookup(NS, keys, PARTS) == 0
        unknown_ca.close()
        plain = open_one(f"redis://{server.address}", FAST)
        assert plain.lookup(NS, keys, PARTS) == 0
        plain.close()
    finally:
        server.stop()


def test_a_cluster_that_never_answered_drops_puts_and_says_so(free_port: int) -> None:
    backend = open_one(f"redis+cluster://127.0.0.1:{free_port}", FAST)
    keys = block_keys(3)
    backend.put(NS, keys[0], 0, b"payload")  # no slot map: nowhere to send it
    assert backend.flush(timeout=10) is False
    assert backend.counters()["unrouted_puts"] == 1
    assert backend.lookup(NS, keys, PARTS) == 0 and backend.promote(NS, keys, PARTS) == {}
    assert backend.flush(timeout=10) is True  # nothing lost since the last flush
    backend.close()
