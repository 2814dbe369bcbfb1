"""A load's runs, deadline and partial failures (tierkv/load.py), through ColdTier, over the
in-memory backend: what the tier does with what a backend answers, without sockets (the vault
tests cover the wire)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest

import tierkv.load
from tierkv.backends.memory import MemoryBackend
from tierkv.keys import chain_block_keys, namespace_fingerprint
from tierkv.quant import get_codec
from tierkv.tier import ColdTier
from tierkv.transfer import Into

NS = namespace_fingerprint({"test": "load"})
KEYS = chain_block_keys(list(range(4 * 32)), block_tokens=32)
KV_PARTS = [0, 1, 2]
PART_BYTES = 2 * 32 * 2 * 64 * 2  # one fp16 part of a block
Arrived = list[tuple[int, int, memoryview]]


class RecordingMemory(MemoryBackend):
    """Records each Promote's key count; can answer nothing from call N on, or each call
    `delay_s` late (a slow vault), or raise (a broken backend); with `places`, puts payloads
    into the buffers `into` gives, as a vault's bulk path does."""

    def __init__(self, places: bool = False) -> None:
        super().__init__()
        self.places = places
        self.calls: list[int] = []
        self.fail_from_call: int | None = None
        self.delay_s = 0.0
        self.raises = False

    def promote(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts: Sequence[int],
        into: Into | None = None,
    ) -> dict[tuple[int, int], memoryview]:
        self.calls.append(len(keys))
        time.sleep(self.delay_s)
        if self.raises:
            raise RuntimeError("a backend that breaks the protocol")
        if self.fail_from_call is not None and len(self.calls) >= self.fail_from_call:
            return {}
        found = super().promote(namespace, keys, parts)
        if not (self.places and into):
            return found
        placement = into(range(len(keys)), parts)
        for slot, payload in found.items():
            buffer = placement[slot][0]
            buffer[: len(payload)] = payload
            found[slot] = buffer
        return found


def kv_blocks() -> dict[tuple[int, int], np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        (index, part): rng.standard_normal((2, 32, 2, 64)).astype(np.float16)
        for index in range(len(KEYS))
        for part in KV_PARTS
    }


def stored_tier(backend: MemoryBackend, **kwargs: float) -> ColdTier:
    tier = ColdTier(get_codec("none"), {"kv": backend}, **kwargs)
    for (index, part), array in kv_blocks().items():
        tier.store(NS, KEYS[index], part, array.copy())
    assert tier.flush(timeout=30)
    return tier


def put_raw(backend: MemoryBackend, parts: Sequence[int], size: int = 100) -> None:
    for key in KEYS:
        for part in parts:
            backend.put(NS, key, part, bytes(size))


def test_a_load_promotes_in_runs_and_a_run_that_returns_nothing_ends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tierkv.load, "PROMOTE_RUN_BYTES", 5 * len(KV_PARTS) * PART_BYTES // 2)
    monkeypatch.setattr(tierkv.load, "FIRST_PROMOTE_RUN_KEYS", 1)
    backend = RecordingMemory()
    tier = stored_tier(backend)
    data = kv_blocks()
    outs = {slot: np.zeros_like(array) for slot, array in data.items()}
    assert tier.load(NS, KEYS, {"kv": KV_PARTS}, lambda i, p: outs[(i, p)]) == set()
    assert backend.calls == [1, 2, 1]  # 4 keys: a first run of one, then runs of 2 keys' bytes
    for slot, array in data.items():
        np.testing.assert_array_equal(outs[slot], array)

    backend.delete(NS, [KEYS[2]])  # a key of the second run, keys 1 and 2, is gone
    backend.calls = []
    failed = tier.load(NS, KEYS, {"kv": KV_PARTS}, lambda i, p: outs[(i, p)])
    assert failed == {2} and backend.calls == [1, 2, 1]

    backend.calls, backend.fail_from_call = [], 2
    failed = tier.load(NS, KEYS, {"kv": KV_PARTS}, lambda i, p: outs[(i, p)])
    assert failed == {1, 2, 3} and backend.calls == [1, 2]  # no third call after an empty run
    stats = tier.stats()
    assert (stats["loaded_blocks"], stats["load_failures"]) == (4 + 3 + 1, 1 + 3)
    tier.close()


def test_no_promote_run_starts_after_the_load_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    # A vault that answers every run slowly, but within its deadline, must not hold a load for
    # one deadline per run: after load_deadline_s no further run starts and the rest is a miss.
    monkeypatch.setattr(tierkv.load, "PROMOTE_RUN_BYTES", 1)  # one key per run: 4 runs
    monkeypatch.setattr(tierkv.load, "FIRST_PROMOTE_RUN_KEYS", 1)
    backend = RecordingMemory()
    tier = stored_tier(backend, load_deadline_s=0.5)
    backend.delay_s = 0.4
    outs = {slot: np.zeros_like(array) for slot, array in kv_blocks().items()}
    failed = tier.load(NS, KEYS, {"kv": KV_PARTS}, lambda i, p: outs[(i, p)])
    assert len(backend.calls) <= 2  # runs 1 and (if run 1 ended by 0.5 s) 2, never 3 or 4
    assert failed == set(range(len(backend.calls), len(KEYS)))
    tier.close()


def test_load_blocks_hands_each_key_whole_to_the_consumer_and_a_raising_one_fails_its_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tierkv.load, "DECODE_TASK_BYTES", 1)  # a call per key
    tier = stored_tier(MemoryBackend())
    calls: list[list[tuple[int, int]]] = []

    def consume(arrived: Arrived) -> set[int]:
        calls.append([(index, part) for index, part, _ in arrived])
        if any(index == 2 for index, _, _ in arrived):
            raise RuntimeError("the engine buffer went away")
        return {1} if any(index == 1 for index, _, _ in arrived) else set()

    assert tier.load_blocks(NS, KEYS, {"kv": KV_PARTS}, consume) == {1, 2}
    assert sorted(sorted(call) for call in calls) == [[(i, p) for p in KV_PARTS] for i in range(4)]
    stats = tier.stats()
    assert (stats["loaded_blocks"], stats["load_failures"]) == (2, 2)
    assert 0 < stats["loaded_payload_bytes"] < sum(a.nbytes for a in kv_blocks().values())
    tier.close()


def test_a_key_is_consumed_only_once_every_vault_has_given_every_part() -> None:
    kv, ssm = MemoryBackend("kv"), MemoryBackend("ssm")
    put_raw(kv, KV_PARTS)
    put_raw(ssm, [0])
    ssm.delete(NS, [KEYS[1]])  # the state of key 1 is lost: its attention KV alone is useless
    tier = ColdTier(get_codec("none"), {"kv": kv, "ssm": ssm})
    calls: list[list[tuple[int, int]]] = []

    def consume(arrived: Arrived) -> set[int]:
        calls.append(sorted((index, part) for index, part, _ in arrived))
        return set()

    assert tier.load_blocks(NS, KEYS, {"kv": KV_PARTS, "ssm": [0]}, consume) == {1}
    consumed = sorted(pair for call in calls for pair in call)
    assert {index for index, _ in consumed} == {0, 2, 3}  # key 1's parts were never consumed
    assert len(consumed) == 3 * (len(KV_PARTS) + 1)
    tier.close()


def test_a_backend_that_raises_fails_the_load_and_not_the_caller() -> None:
    broken = RecordingMemory()
    put_raw(broken, KV_PARTS)
    broken.raises = True
    tier = ColdTier(get_codec("none"), {"kv": broken})
    assert tier.load_blocks(NS, KEYS, {"kv": KV_PARTS}, lambda arrived: set()) == set(range(4))
    assert tier.stats()["load_failures"] == 4
    tier.close()


def place_in_buffers(indices: Sequence[int], parts: Sequence[int]) -> dict:
    return {(index, part): [memoryview(bytearray(100))] for index in indices for part in parts}


def test_the_first_placed_run_is_sized_from_the_previous_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From a backend that places payloads, runs are about PLACED_RUN_BYTES; the first one of a
    load is sized from the bytes per key of the previous load from the same backend (the first
    load has none)."""
    key_bytes = len(KV_PARTS) * 100
    monkeypatch.setattr(tierkv.load, "PLACED_RUN_BYTES", 2 * key_bytes)
    monkeypatch.setattr(tierkv.load, "FIRST_PROMOTE_RUN_KEYS", 1)
    backend = RecordingMemory(places=True)
    put_raw(backend, KV_PARTS, size=100)
    tier = ColdTier(get_codec("none"), {"kv": backend})
    for _ in range(2):
        load = tier.load_blocks(NS, KEYS, {"kv": KV_PARTS}, lambda a: set(), place_in_buffers)
        assert load == set()
    assert backend.calls == [1, 2, 1, 2, 2]  # FIRST_PROMOTE_RUN_KEYS; then 2 keys' bytes
    tier.close()


def test_a_backend_that_ignores_into_is_asked_in_the_runs_it_would_be_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Redis or a file tier ignores `into`: it keeps PROMOTE_RUN_BYTES runs (a run of
    PLACED_RUN_BYTES made a Redis answer one 64 MiB MGET, slower than eight of 8 MiB)."""
    key_bytes = len(KV_PARTS) * 100
    monkeypatch.setattr(tierkv.load, "PLACED_RUN_BYTES", 4 * key_bytes)
    monkeypatch.setattr(tierkv.load, "PROMOTE_RUN_BYTES", key_bytes)
    monkeypatch.setattr(tierkv.load, "FIRST_PROMOTE_RUN_KEYS", 1)
    backend = RecordingMemory()
    put_raw(backend, KV_PARTS, size=100)
    tier = ColdTier(get_codec("none"), {"kv": backend})
    for _ in range(2):
        load = tier.load_blocks(NS, KEYS, {"kv": KV_PARTS}, lambda a: set(), place_in_buffers)
        assert load == set()
    assert backend.calls == [1, 1, 1, 1] * 2
    tier.close()
