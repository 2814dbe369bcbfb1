"""ColdTier against real in-process vaults and the real codecs."""

import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from helpers import SLOW_BOX_MARGIN_S, VaultHandle, flip_byte

from tierkv.backends.vault import VaultClient
from tierkv.config import config_from_mapping
from tierkv.keys import chain_block_keys, namespace_fingerprint
from tierkv.load import LOAD_SWITCH_INTERVAL_S, SwitchInterval
from tierkv.quant import NonFiniteError, get_codec
from tierkv.tier import ColdTier

NS = namespace_fingerprint({"test": "tier"})
KEYS = chain_block_keys(list(range(4 * 32)), block_tokens=32)
KV_PARTS = [0, 1, 2]
SSM_PARTS = [0]


def blocks(seed: int = 0) -> dict[tuple[int, str, int], np.ndarray]:
    rng = np.random.default_rng(seed)
    found = {}
    for index in range(len(KEYS)):
        for part in KV_PARTS:
            found[(index, "kv", part)] = rng.standard_normal((2, 32, 2, 64)).astype(np.float16)
        for part in SSM_PARTS:
            found[(index, "ssm", part)] = rng.standard_normal(4096).astype(np.float32)
    return found


def make_tier(codec: str, kv: VaultHandle, ssm: VaultHandle, deadline_s: float = 2.0) -> ColdTier:
    clients = {
        name: VaultClient(handle.address, deadline_s=deadline_s, promote_deadline_s=deadline_s)
        for name, handle in (("kv", kv), ("ssm", ssm))
    }
    return ColdTier(get_codec(codec, group_size=64), clients)


def store_all(tier: ColdTier, data: dict[tuple[int, str, int], np.ndarray]) -> None:
    for (index, vault, part), array in data.items():
        tier.store(NS, KEYS[index], part, array.copy(), vault=vault)
    assert tier.flush(timeout=30)


def load_all(
    tier: ColdTier, data: dict[tuple[int, str, int], np.ndarray], keys: list[bytes] = KEYS
) -> tuple[set[int], dict[tuple[int, str, int], np.ndarray]]:
    outs = {slot: np.zeros_like(array) for slot, array in data.items()}

    def out_for(vault: str) -> Callable[[int, int], np.ndarray]:
        return lambda index, part: outs[(index, vault, part)]

    failed = set()
    for vault, parts in (("kv", KV_PARTS), ("ssm", SSM_PARTS)):
        failed |= tier.load(NS, keys, {vault: parts}, out_for(vault))
    return failed, outs


@pytest.fixture
def two_vaults(vault_factory: Callable[..., VaultHandle]) -> tuple[VaultHandle, VaultHandle]:
    return vault_factory(), vault_factory(role="ssm_cold")


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_store_lookup_load_round_trip(
    codec: str, two_vaults: tuple[VaultHandle, VaultHandle]
) -> None:
    tier = make_tier(codec, *two_vaults)
    data = blocks()
    store_all(tier, data)
    assert tier.lookup(NS, KEYS, {"kv": KV_PARTS, "ssm": SSM_PARTS}) == len(KEYS)
    failed, outs = load_all(tier, data)
    assert failed == set()
    for slot, array in data.items():
        if codec == "none" or slot[1] == "ssm":  # SSM state is always stored lossless
            np.testing.assert_array_equal(outs[slot], array)
        else:
            np.testing.assert_allclose(outs[slot], array, atol=0.05, rtol=0.02)
    assert tier.stats()["loaded_blocks"] == 2 * len(KEYS)
    tier.close()


def test_hit_is_the_prefix_every_vault_holds(two_vaults: tuple[VaultHandle, VaultHandle]) -> None:
    tier = make_tier("none", *two_vaults)
    data = blocks()
    del data[(2, "ssm", 0)]  # the SSM vault lacks block 2
    store_all(tier, data)
    assert tier.lookup(NS, KEYS, {"kv": KV_PARTS}) == 4
    assert tier.lookup(NS, KEYS, {"kv": KV_PARTS, "ssm": SSM_PARTS}) == 2
    outs = {0: np.zeros(4096, np.float32)}
    failed = tier.load(NS, KEYS, {"ssm": SSM_PARTS}, lambda index, part: outs[0])
    assert failed == {2}
    tier.close()


def test_corrupted_payload_is_a_failed_block_never_data(
    two_vaults: tuple[VaultHandle, VaultHandle],
) -> None:
    kv, ssm = two_vaults
    tier = make_tier("none", kv, ssm)
    data = blocks()
    store_all(tier, data)
    flip_byte(kv.store, (NS, KEYS[1], 2), -1)
    failed, outs = load_all(tier, data)
    assert failed == {1}
    for slot, array in data.items():
        if slot[0] != 1:
            np.testing.assert_array_equal(outs[slot], array)
    tier.close()


def test_non_finite_blocks_are_skipped_not_stored(
    two_vaults: tuple[VaultHandle, VaultHandle],
) -> None:
    tier = make_tier("int8", *two_vaults)
    bad = np.ones((2, 32, 2, 64), np.float16)
    bad[0, 3, 1, 7] = np.inf
    tier.store(NS, KEYS[0], 0, bad)
    assert tier.flush(timeout=30)
    assert tier.stats()["skipped_nonfinite"] == 1
    assert tier.lookup(NS, KEYS, {"kv": [0]}) == 0
    tier.close()


def test_unknown_vault_is_named(two_vaults: tuple[VaultHandle, VaultHandle]) -> None:
    kv, _ = two_vaults
    tier = ColdTier(get_codec("none"), {"kv": VaultClient(kv.address)})
    with pytest.raises(ValueError, match="'ssm' vault"):
        tier.store(NS, KEYS[0], 0, np.zeros(8, np.float16), vault="ssm")
    tier.close()


def test_dead_vault_is_a_fast_miss(two_vaults: tuple[VaultHandle, VaultHandle]) -> None:
    kv, ssm = two_vaults
    deadline_s = 2.0
    tier = make_tier("none", kv, ssm, deadline_s=deadline_s)
    data = blocks()
    store_all(tier, data)
    kv.stop()
    start = time.monotonic()
    for (index, vault, part), array in data.items():
        tier.store(NS, KEYS[index], part, array, vault=vault)
    assert time.monotonic() - start < deadline_s, "store must never wait for a vault"
    start = time.monotonic()
    assert tier.lookup(NS, KEYS, {"kv": KV_PARTS, "ssm": SSM_PARTS}) == 0
    failed, _ = load_all(tier, data)
    assert failed == set(range(len(KEYS)))
    assert time.monotonic() - start < 3 * deadline_s + SLOW_BOX_MARGIN_S
    tier.close()


def test_a_block_missing_a_part_is_not_decoded_at_all(
    two_vaults: tuple[VaultHandle, VaultHandle],
) -> None:
    kv, _ = two_vaults
    tier = make_tier("none", *two_vaults)
    data = blocks()
    store_all(tier, data)
    kv.store.delete(NS, [KEYS[1]])  # every kv part of block 1 gone ...
    tier.store(NS, KEYS[1], 0, data[(1, "kv", 0)].copy(), vault="kv")  # ... but part 0
    assert tier.flush(timeout=30)
    written: list[tuple[int, int]] = []

    def out_for(index: int, part: int) -> np.ndarray:
        written.append((index, part))
        return np.zeros_like(data[(index, "kv", part)])

    assert tier.load(NS, KEYS, {"kv": KV_PARTS}, out_for) == {1}
    assert sorted(written) == [(i, p) for i in (0, 2, 3) for p in KV_PARTS]
    tier.close()


@pytest.mark.parametrize(("min_cosine", "lossless"), [(0.0, False), (0.999, True)])
def test_min_cosine_from_the_config_stores_a_poor_block_lossless(
    vault_factory: Callable[..., VaultHandle], min_cosine: float, lossless: bool
) -> None:
    """`[compression] min_cosine` reaches ColdTier.from_config: tq2 (cosine ~0.94) falls back."""
    vault = vault_factory()
    cfg = config_from_mapping(
        {
            "cluster.kv_cold": vault.address,
            "compression.enabled": True,
            "compression.codec": "tq2",
            "compression.group_size": 64,
            "compression.min_cosine": min_cosine,
        },
        source="test",
    )
    tier = ColdTier.from_config(cfg)
    try:
        block = np.random.default_rng(0).standard_normal((2, 32, 2, 64)).astype(np.float16)
        tier.store(NS, KEYS[0], 0, block.copy())
        assert tier.flush(timeout=30)
        out = np.zeros_like(block)
        assert tier.load(NS, KEYS[:1], {"kv": [0]}, lambda index, part: out) == set()
        assert np.array_equal(out, block) is lossless
        ratio = tier.stats()["queued_raw_bytes"] / tier.stats()["queued_payload_bytes"]
        assert (ratio < 1.01) is lossless
    finally:
        tier.close()


def test_a_block_over_the_pending_encode_budget_is_dropped_and_counted(
    vault_factory: Callable[..., VaultHandle],
) -> None:
    vault = vault_factory()
    block = np.ones((2, 32, 2, 64), np.float16)
    tier = ColdTier(
        get_codec("none"), {"kv": VaultClient(vault.address)}, max_pending_encode_bytes=block.nbytes
    )
    try:
        tier.store(NS, KEYS[0], 0, np.ones(block.size + 1, np.float16))  # over the budget alone
        tier.store(NS, KEYS[1], 0, block)
        assert tier.flush(timeout=30)
        stats = tier.stats()
        assert (stats["dropped_backpressure"], stats["queued_blocks"]) == (1, 1)
        assert tier.lookup(NS, KEYS[1:2], {"kv": [0]}) == 1
        assert tier.lookup(NS, KEYS[:1], {"kv": [0]}) == 0
    finally:
        tier.close()


def test_counters_tell_queued_from_acknowledged_rejected_and_dropped(
    two_vaults: tuple[VaultHandle, VaultHandle],
) -> None:
    kv, ssm = two_vaults
    tier = make_tier("none", kv, ssm)
    data = blocks()
    store_all(tier, data)
    stored = tier.stats()
    assert stored["queued_blocks"] == stored["acknowledged_blocks"] == len(data)
    assert stored["rejected_blocks"] == stored["dropped_blocks"] == 0

    kv.stop()  # a dead vault: what is queued for it is lost, never "sent"
    kv_blocks = [(slot, array) for slot, array in data.items() if slot[1] == "kv"]
    for (index, vault, part), array in kv_blocks:
        tier.store(NS, KEYS[index], part, array.copy(), vault=vault)
    assert not tier.flush(timeout=30)
    lost = tier.stats()
    assert lost["queued_blocks"] == len(data) + len(kv_blocks)
    assert lost["acknowledged_blocks"] == len(data)
    assert lost["dropped_blocks"] == len(kv_blocks)
    tier.close()


@pytest.mark.parametrize(
    ("state", "min_cosine", "lossless"),
    [(False, 0.0, False), (True, 0.0, True), (False, 0.5, True)],
)
def test_warm_up_compiles_the_lossless_encoder_only_when_something_is_stored_lossless(
    state: bool, min_cosine: float, lossless: bool
) -> None:
    """An int8 engine without recurrent state and without the min_cosine fallback never encodes
    lossless (lossless decoding is a plain copy): its start-up does not compile that kernel.
    A fresh interpreter, so only what warm_up compiled (or loaded from the cache) is there."""
    probe = (
        "from tierkv.quant import get_codec\n"
        "from tierkv.quant.lossless import copy_checked_serial\n"
        "from tierkv.tier import ColdTier\n"
        f"tier = ColdTier(get_codec('int8', 64), {{}}, min_cosine={min_cosine})\n"
        f"tier.warm_up(('bf16',), 1 << 15, state={state})\n"
        "print(tier.warmed_codecs, bool(copy_checked_serial.signatures))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    codecs = ("int8", "none") if lossless else ("int8",)
    assert done.stdout.split("\n")[-2] == f"{codecs} {lossless}"


def test_a_load_runs_with_a_short_switch_interval_and_puts_it_back(vault: VaultHandle) -> None:
    """A thread busy in Python keeps the GIL for a switch interval each time a load's thread
    wants it back (5 ms by default): the load shortens it while it runs."""
    data = {slot: array for slot, array in blocks().items() if slot[1] == "kv"}
    tier = ColdTier(get_codec("int8"), {"kv": VaultClient(vault.address)})
    store_all(tier, data)
    before = sys.getswitchinterval()
    seen: list[float] = []

    def consume(arrived: list[tuple[int, int, memoryview]]) -> set[int]:
        seen.append(sys.getswitchinterval())
        return set()

    assert tier.load_blocks(NS, KEYS, {"kv": KV_PARTS}, consume) == set()
    assert seen and max(seen) <= LOAD_SWITCH_INTERVAL_S < before
    assert sys.getswitchinterval() == before
    tier.close()


def test_the_switch_interval_is_put_back_by_the_last_load_and_left_alone_if_changed() -> None:
    before = sys.getswitchinterval()
    short = SwitchInterval(0.0003)
    entered, leave = threading.Event(), threading.Event()

    def other_load() -> None:
        with short:
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other_load)
    try:
        with short:
            thread.start()
            assert entered.wait(10)
        assert sys.getswitchinterval() == pytest.approx(0.0003)  # the other load still runs
        leave.set()
        thread.join()
        assert sys.getswitchinterval() == before
        with short:
            sys.setswitchinterval(0.002)  # someone else's choice, made meanwhile
        assert sys.getswitchinterval() == pytest.approx(0.002)
        sys.setswitchinterval(0.0001)
        with short:  # already shorter: left as it is
            assert sys.getswitchinterval() == pytest.approx(0.0001)
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    finally:
        leave.set()
        sys.setswitchinterval(before)


@pytest.mark.parametrize("bulk", [True, False])
def test_a_lossless_block_is_sent_from_its_own_memory_and_released_once_sent(
    bulk: bool, vault_factory: Callable[..., VaultHandle]
) -> None:
    """A lossless block travels as a header and the block's own memory, over the bulk path
    and over gRPC: the tier calls on_done only once the vault has answered its put, so a
    caller that reuses the block's memory then (as the data mover reuses its staging ring)
    never changes what was stored."""
    kv, ssm = vault_factory(bulk=bulk), vault_factory(role="ssm_cold", bulk=bulk)
    tier = make_tier("none", kv, ssm)
    data = {slot: array for slot, array in blocks(3).items() if slot[1] == "kv"}
    released: list[bool] = []

    def reuse(staging: np.ndarray) -> Callable[[], None]:
        def on_done() -> None:
            released.append(tier.vaults["kv"].stored_puts > len(released))
            staging[...] = np.float16(np.nan)  # the engine's next block lands here

        return on_done

    for (index, vault, part), array in data.items():
        staging = array.copy()
        tier.store(NS, KEYS[index], part, staging, vault=vault, on_done=reuse(staging))
    assert tier.flush(timeout=30)
    assert len(released) == len(data) and all(released)
    outs = {slot: np.zeros_like(array) for slot, array in data.items()}
    failed = tier.load(NS, KEYS, {"kv": KV_PARTS}, lambda i, part: outs[(i, "kv", part)])
    assert failed == set()
    for slot, array in data.items():
        assert outs[slot].tobytes() == array.tobytes()
    assert tier.stats()["queued_payload_bytes"] == sum(
        len(get_codec("none", 64).encode(array)) for array in data.values()
    )
    tier.close()


def test_lossless_pieces_are_the_encoded_payload_without_a_copy() -> None:
    block = np.random.default_rng(0).standard_normal((32, 2, 64)).astype(np.float16)
    codec = get_codec("none", 64)
    header, body = codec.encode_pieces(block)
    assert header + bytes(body) == codec.encode(block)
    assert np.shares_memory(np.frombuffer(body, np.uint8), block)
    block[0, 0, 0] = np.inf
    with pytest.raises(NonFiniteError):
        codec.encode_pieces(block)


def test_stored_form_is_what_store_sends_lossless_for_state_encoded_for_kv() -> None:
    """The one place that chooses a block's stored form (the bench times it too): a lossless
    codec's block is its header and a view of its own memory, the "ssm" vault's state is
    lossless whatever the codec, any other block is the codec's payload."""
    block = np.arange(2 * 64, dtype=np.float16).reshape(2, 64)
    none, int8 = get_codec("none", 64), get_codec("int8", 64)
    lossless = ColdTier(none, {})
    pieces = lossless.stored_form(block)
    assert isinstance(pieces, tuple) and b"".join(pieces) == none.encode(block)
    assert np.shares_memory(np.frombuffer(pieces[1], np.uint8), block)
    lossy = ColdTier(int8, {})
    assert lossy.stored_form(block) == int8.encode(block)
    state = lossy.stored_form(block, vault="ssm")
    assert isinstance(state, tuple) and b"".join(state) == none.encode(block)
    blocks = [block * np.float16(i) for i in range(5)]
    assert lossy.stored_forms(blocks) == [int8.encode(b) for b in blocks]
    lossless.close()
    lossy.close()
