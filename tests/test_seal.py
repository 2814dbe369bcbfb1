"""Sealed blocks: the data key file, the AEAD format, and ColdTier sealing through a real vault and
a real Valkey / Redis (tampered, moved or foreign blocks are counted misses, never data)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import VaultHandle

from tests.redis_servers import RedisServer, start_redis
from tierkv.backends import open_backend
from tierkv.backends.redis import redis_key
from tierkv.backends.vault import VaultClient
from tierkv.checksum import block_checksum
from tierkv.config import ClientConfig, ConfigError, Endpoint, config_from_mapping
from tierkv.keys import chain_block_keys, namespace_fingerprint
from tierkv.quant import get_codec
from tierkv.seal import OVERHEAD_BYTES, Sealer, SealError, block_address, new_data_key_line
from tierkv.tier import ColdTier
from tierkv.transfer import RECEIVE_BUFFERS

NS = namespace_fingerprint({"test": "seal"})
KEYS = chain_block_keys(list(range(4 * 16)), block_tokens=16)
PATTERN = np.frombuffer(b"PLAINTEXT-KV-0123456789abcdef!!!" * 64, dtype=np.float16)
"""A block whose bytes are a recognisable plaintext (2048 fp16 values)."""


def key_file(tmp_path: Path, *ids: int, name: str = "data.keys") -> Path:
    path = tmp_path / name
    path.write_text("# data keys\n" + "".join(new_data_key_line(i) for i in ids))
    path.chmod(0o600)
    return path


def test_key_file_rotation_old_keys_open_the_newest_seals(tmp_path: Path) -> None:
    path = key_file(tmp_path, 1)
    old = Sealer.from_file(path)
    address = block_address(NS, KEYS[0], 0)
    head, body = old.seal(address, b"head", memoryview(b"body bytes"))
    with path.open("a") as file:
        file.write(new_data_key_line(7))
    rotated = Sealer.from_file(path)
    assert rotated.key_id == 7
    sealed = memoryview(head + bytes(body))
    out = memoryview(bytearray(rotated.opened_bytes(sealed)))
    rotated.open_into(address, sealed, out)
    assert bytes(out) == b"headbody bytes"
    new_head, new_body = rotated.seal(address, b"head", memoryview(b"body bytes"))
    with pytest.raises(SealError, match="data key 7"):
        old.open_into(address, memoryview(new_head + bytes(new_body)), out)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1 c2hvcnQ\n", "line 1: key 1 is 5 bytes; a data key is 32"),
        ("1 %%%\n", "line 1: key 1 is not URL-safe base64"),
        ("0 " + "A" * 43 + "\n", "line 1: expected KEY_ID KEY"),
        ("# only a comment\n", "no key in it"),
        ("1 " + "A" * 43 + "\n1 " + "B" * 43 + "\n", "line 2: key id 1 is listed twice"),
    ],
)
def test_bad_key_files_are_refused_with_one_line_naming_the_file(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "data.keys"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as refused:
        Sealer.from_file(path)
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)


def test_a_sealed_payload_opens_only_unchanged_at_its_own_address(tmp_path: Path) -> None:
    sealer = Sealer.from_file(key_file(tmp_path, 1))
    address = block_address(NS, KEYS[0], 0)
    head, body = sealer.seal(address, b"HEADER", memoryview(PATTERN.tobytes()))
    sealed = head + bytes(body)
    assert (
        PATTERN.tobytes()[:64] not in sealed and len(sealed) == 6 + PATTERN.nbytes + OVERHEAD_BYTES
    )
    out = memoryview(bytearray(len(sealed) - OVERHEAD_BYTES))
    elsewhere = [block_address(NS, KEYS[1], 0), block_address(NS, KEYS[0], 1)]
    elsewhere.append(block_address(namespace_fingerprint({"other": "model"}), KEYS[0], 0))
    for other in elsewhere:
        with pytest.raises(SealError):
            sealer.open_into(other, memoryview(sealed), out)
    for at in (0, 20, 26, len(sealed) // 2, len(sealed) - 1):  # headers, clear part, body, tag
        changed = bytearray(sealed)
        changed[at] ^= 1
        with pytest.raises(SealError):
            sealer.open_into(address, memoryview(changed), out)
    with pytest.raises(SealError):
        sealer.open_into(address, memoryview(sealed[:-1]), out[:-1])
    sealer.open_into(address, memoryview(sealed), out)
    assert bytes(out) == b"HEADER" + PATTERN.tobytes()


def test_nonces_of_one_sealer_never_repeat(tmp_path: Path) -> None:
    sealer = Sealer.from_file(key_file(tmp_path, 1))
    nonces = {sealer.seal(b"a", b"", memoryview(b"x"))[0][12:24] for _ in range(1000)}
    assert len(nonces) == 1000


def test_sealed_copies_share_pooled_memory_only_once_released(tmp_path: Path) -> None:
    sealer = Sealer.from_file(key_file(tmp_path, 1))
    size = RECEIVE_BUFFERS.buffer_bytes // 5  # several to a pooled buffer, not a whole number
    sizes = [size, 3 * size, 1, RECEIVE_BUFFERS.buffer_bytes + 1] + [size] * 12
    bodies = [np.random.default_rng(i).integers(0, 256, n, np.uint8) for i, n in enumerate(sizes)]
    addresses = [block_address(NS, i.to_bytes(16, "little"), 0) for i in range(len(sizes))]
    kept = [sealer.seal(a, b"", b.data) for a, b in zip(addresses, bodies, strict=True)]
    sealer.seal(addresses[0], b"", bodies[0].data)  # sealed and dropped at once
    for address, body, (head, sealed) in zip(addresses, bodies, kept, strict=True):
        out = memoryview(bytearray(len(body)))
        sealer.open_into(address, memoryview(head + bytes(sealed)), out)
        assert bytes(out) == body.tobytes()  # no later seal wrote over a copy still held
    small = [sealed.obj for _, sealed in kept[4:]]  # .obj: the memory the view lies in
    assert len({id(buffer) for buffer in small}) <= 4  # 12 copies cut from a few pooled buffers
    held = {id(buffer) for buffer in small}
    del kept, small
    again = [sealer.seal(a, b"", b.data)[1] for a, b in zip(addresses, bodies, strict=True)]
    assert held & {id(sealed.obj) for sealed in again[4:]}  # released buffers are used again


def sealed_tier(path: Path | None, backend: object, codec: str = "none") -> ColdTier:
    sealer = Sealer.from_file(path) if path is not None else None
    return ColdTier(get_codec(codec, group_size=64), {"kv": backend}, sealer=sealer)  # type: ignore[dict-item]


def round_trip(tier: ColdTier, blocks: list[np.ndarray]) -> tuple[set[int], list[np.ndarray]]:
    for index, block in enumerate(blocks):
        tier.store(NS, KEYS[index], 0, block.copy())
    assert tier.flush(timeout=30)
    outs = [np.zeros_like(block) for block in blocks]
    failed = tier.load(NS, KEYS[: len(blocks)], {"kv": [0]}, lambda i, part: outs[i])
    return failed, outs


def pattern_blocks(count: int = 4) -> list[np.ndarray]:
    return [np.roll(PATTERN, index).reshape(2, 16, 32) for index in range(count)]


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_tier_seals_what_the_vault_holds_and_opens_it(
    tmp_path: Path, vault: VaultHandle, codec: str
) -> None:
    tier = sealed_tier(key_file(tmp_path, 1), VaultClient(vault.address), codec)
    try:
        blocks = pattern_blocks()
        failed, outs = round_trip(tier, blocks)
        assert failed == set()
        for block, out in zip(blocks, outs, strict=True):
            if codec == "none":
                assert np.array_equal(block, out)
        stored = [bytes(found.payload) for found in vault.store.get_many(NS, KEYS[:4], [0])]
        assert len(stored) == 4 and all(PATTERN.tobytes()[:64] not in p for p in stored)
        stats = tier.stats()
        assert stats["sealed_blocks"] == 4 and stats["open_failures"] == 0
    finally:
        tier.close()


def test_another_tenants_key_or_no_key_gives_misses_only(
    tmp_path: Path, vault: VaultHandle
) -> None:
    """Blocks written at A's addresses under B's data key (or unsealed) never reach A as data."""
    writer_b = sealed_tier(key_file(tmp_path, 1, name="b.keys"), VaultClient(vault.address))
    plain = sealed_tier(None, VaultClient(vault.address))
    reader_a = sealed_tier(key_file(tmp_path, 1, name="a.keys"), VaultClient(vault.address))
    try:
        blocks = pattern_blocks()
        for index, block in enumerate(blocks[:2]):
            writer_b.store(NS, KEYS[index], 0, block.copy())
        for index, block in enumerate(blocks[2:], 2):
            plain.store(NS, KEYS[index], 0, block.copy())
        assert writer_b.flush(timeout=30) and plain.flush(timeout=30)
        outs = [np.zeros_like(block) for block in blocks]
        failed = reader_a.load(NS, KEYS[:4], {"kv": [0]}, lambda i, part: outs[i])
        assert failed == {0, 1, 2, 3}
        assert reader_a.stats()["open_failures"] == 4
    finally:
        for tier in (writer_b, plain, reader_a):
            tier.close()


def test_data_key_file_in_config_seals_every_engine_side_tier(
    tmp_path: Path, vault: VaultHandle
) -> None:
    path = key_file(tmp_path, 3)
    cfg = config_from_mapping(
        {"cluster": {"kv_cold": vault.address}, "security": {"data_key_file": str(path)}}, "test"
    )
    tier = ColdTier.from_config(cfg, warm_dtypes=())
    try:
        assert tier.sealer is not None and tier.sealer.key_id == 3
    finally:
        tier.close()
    path.write_text("1 c2hvcnQ\n")
    with pytest.raises(ConfigError, match="data_key_file"):
        ColdTier.from_config(cfg, warm_dtypes=())


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path)
    yield server
    server.stop()


def test_redis_holds_sealed_blocks_and_a_tampered_one_is_a_counted_miss(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    backend = open_backend(
        [Endpoint(f"redis://{redis_server.address}")], ClientConfig(deadline_ms=2000), None
    )
    tier = sealed_tier(key_file(tmp_path, 1), backend)
    try:
        blocks = pattern_blocks()
        failed, outs = round_trip(tier, blocks)
        assert failed == set() and all(map(np.array_equal, blocks, outs))
        raw = redis_server.client()
        stored = [raw.get(redis_key(NS, key, 0)) for key in KEYS[:4]]
        assert all(value and PATTERN.tobytes()[:64] not in value for value in stored)
        # Whoever can write to the Redis (and knows its unkeyed checksum) changes a byte of
        # block 1 and moves block 3's payload to key 2.
        changed = bytearray(stored[1][8:])
        changed[len(changed) // 2] ^= 1
        moved = stored[3][8:]
        for key, payload in ((KEYS[1], bytes(changed)), (KEYS[2], moved)):
            checksum = block_checksum(NS, key, 0, payload).to_bytes(8, "little")
            raw.set(redis_key(NS, key, 0), checksum + payload)
        outs = [np.zeros_like(block) for block in blocks]
        failed = tier.load(NS, KEYS[:4], {"kv": [0]}, lambda i, part: outs[i])
        assert failed == {1, 2} and tier.stats()["open_failures"] == 2
        assert np.array_equal(outs[0], blocks[0]) and np.array_equal(outs[3], blocks[3])
        raw.close()
    finally:
        tier.close()
