"""tierkv.movers: batched gather / scatter of paged blocks, the staging ring, constant op counts."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from helpers import flip_byte

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tierkv.load import LOAD_SWITCH_INTERVAL_S  # noqa: E402
from tierkv.movers import BlockMover, StagingRing, countdown  # noqa: E402


class CountOps(TorchDispatchMode):
    """Counts every torch operation dispatched inside the `with` block (on this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def paged(num_blocks: int, layers: int = 3) -> list[torch.Tensor]:
    """K/V-first layers ([2, blocks, tokens, heads × dim]): every block is a strided view."""
    return [torch.randn(2, num_blocks, 4, 16).to(torch.bfloat16) for _ in range(layers)]


def mover_of(caches: list[torch.Tensor], staging_bytes: int = 1 << 22) -> BlockMover:
    return BlockMover(
        [[(cache, 1) for cache in caches]], StagingRing(staging_bytes), StagingRing(staging_bytes)
    )


def round_trip_ops(n: int) -> tuple[int, int]:
    """Torch operations of one store and one load (staging + scatter) of n blocks, one failed."""
    caches = paged(2 * n + 1)
    mover = mover_of(caches)
    with CountOps() as store_ops:
        staged = mover.store(list(range(n)))
        assert staged is not None
        arrays = staged.arrays()
    with CountOps() as load_ops:
        load = mover.staging(n)
        for out, stored in zip(load.arrays(), arrays, strict=True):
            np.copyto(out, stored)  # what decoding does, without torch
        good = list(range(1, n))  # slot 0 "failed to decode"
        mover.scatter(load, good, [n + 1 + slot for slot in good])
    for cache in caches:
        assert torch.equal(cache[:, n + 2 : 2 * n + 1], cache[:, 1:n])
        assert not torch.equal(cache[:, n + 1], cache[:, 0])  # the failed slot was not written
    return store_ops.count, load_ops.count


def test_one_store_and_one_load_issue_as_many_torch_ops_for_few_blocks_as_for_many():
    few = round_trip_ops(4)
    many = round_trip_ops(200)
    assert few == many
    assert few[0] <= 3 * 4 * 3  # a few per layer (3 layers), none per block


def test_store_copies_blocks_of_any_layout_and_parts_stack_layers():
    caches = paged(6, layers=2)
    mover = mover_of(caches)
    staged = mover.store([4, 1])
    assert staged is not None and staged.done()
    (stored,) = staged.tensors
    assert stored.shape == (2, 2, 2, 4, 16)  # [blocks, layers, K|V, tokens, heads × dim]
    assert torch.equal(stored[0, 1], caches[1][:, 4])
    assert torch.equal(stored[1, 0], caches[0][:, 1])
    (words,) = staged.arrays()
    assert words.dtype == np.int16 and words.shape == stored.shape
    assert mover.codec_dtypes == ["bf16"]


def test_parts_of_different_dtypes_and_layer_mismatch():
    states = torch.randn(5, 8)
    conv = torch.randn(5, 4).to(torch.float16)
    mover = BlockMover([[(states, 0)], [(conv, 0)]], StagingRing(4096), StagingRing(4096))
    staged = mover.store([3])
    assert staged is not None
    assert torch.equal(staged.tensors[0][0, 0], states[3])
    assert torch.equal(staged.tensors[1][0, 0], conv[3])
    with pytest.raises(ValueError, match="layers of one part differ"):
        mover_of([torch.zeros(2, 4, 4, 16), torch.zeros(2, 4, 4, 8)])


def test_staging_ring_reuses_space_in_order_and_refuses_what_does_not_fit():
    ring = StagingRing(1024)
    first, second, third = (ring.take(256) for _ in range(3))
    assert first is not None and second is not None and third is not None
    assert ring.largest_free() == 256
    assert ring.take(512) is None
    second.release()
    assert ring.largest_free() == 256  # `first` still holds the head of the ring
    first.release()
    assert ring.largest_free() == 512  # the wrapped span before `third`
    wrapped = ring.take(512)
    assert wrapped is not None and wrapped.data.data_ptr() == first.data.data_ptr()
    assert ring.take(1) is None  # from `wrapped` up to `third`, the oldest, nothing is free
    third.release()
    wrapped.release()
    assert ring.largest_free() == 1024


def test_staging_never_exceeds_the_ring_and_drops_what_does_not_fit():
    caches = paged(8, layers=1)
    block = 2 * 4 * 16 * 2
    mover = mover_of(caches, staging_bytes=2 * block)
    assert mover.fitting(5, mover.store_ring) == 2
    held = mover.store([0, 1])
    assert held is not None
    assert mover.fitting(1, mover.store_ring) == 0 and mover.store([2]) is None
    held.release()
    assert mover.fitting(5, mover.store_ring) == 2


def back_to_back(payloads: list[bytes]) -> list[memoryview]:
    """The payloads as a Promote receives them: slices of one buffer, one after the other."""
    buffer = memoryview(b"".join(payloads)).toreadonly()
    ends = np.cumsum([len(payload) for payload in payloads])
    return [buffer[end - len(payload) : end] for payload, end in zip(payloads, ends, strict=True)]


def encoded_blocks(
    n: int, codec: str, odd_one: int, odd_codec: str
) -> tuple[list[torch.Tensor], BlockMover, list[bytes]]:
    """Paged layers of 2n blocks, a mover over them and the payloads of blocks 0..n-1 (to
    restore into blocks n..2n-1), encoded with `codec`, block `odd_one` with `odd_codec`."""
    from tierkv.quant import encode_block, get_codec

    caches = paged(2 * n)
    mover = mover_of(caches)
    staged = mover.store(list(range(n)))
    assert staged is not None
    blocks = staged.arrays()[0]
    usual, odd = get_codec(codec, 16), get_codec(odd_codec, 16)
    payloads = [encode_block(odd if i == odd_one else usual, blocks[i], "bf16") for i in range(n)]
    staged.release()
    return caches, mover, payloads


def corrupt_header(payloads: list[bytes], index: int) -> None:
    """Flip a header byte (the group size) of payloads[index]: its header checksum fails."""
    corrupt = bytearray(payloads[index])
    corrupt[10] ^= 1
    payloads[index] = bytes(corrupt)


def test_a_load_copies_lossless_payloads_from_the_receive_buffer_and_never_bad_ones():
    n = 12
    caches, mover, payloads = encoded_blocks(n, "none", 5, "int8")
    for bad in (7, 9):
        corrupt_header(payloads, bad)
    received = back_to_back(payloads)
    before = [cache.clone() for cache in caches]

    def fetch(start: int, stop: int, consume, into) -> set[int]:
        arrived = [(i - start, 0, received[i]) for i in range(start, stop)]
        return consume(arrived[:7]) | consume(arrived[7:])  # bad block 7 first of its run

    assert mover.load(list(range(n, 2 * n)), fetch, batch_blocks=n) == {7, 9}
    for cache, old in zip(caches, before, strict=True):
        for i in range(n):
            restored, original = cache[:, n + i], cache[:, i]
            if i in (7, 9):
                assert torch.equal(restored, old[:, n + i])  # never written
            elif i == 5:  # another codec among lossless ones: decoded
                assert torch.allclose(restored.float(), original.float(), atol=0.05, rtol=0.02)
            else:
                assert torch.equal(restored, original)


def test_a_load_decodes_a_run_of_lossy_payloads_in_one_call(monkeypatch):
    import tierkv.quant
    from tierkv.quant import decode_into

    n = 10
    caches, mover, payloads = encoded_blocks(n, "int8", 3, "tq4")
    expected = []
    for payload in payloads:
        expected.append(np.empty((len(caches), 2, 4, 16), np.uint16))
        decode_into(payload, expected[-1])
    corrupt_header(payloads, 8)  # does not decode
    received = back_to_back(payloads)
    alone: list[int] = []  # the blocks decoded one by one

    def one_by_one(payload, out):
        alone.append(len(payload))
        decode_into(payload, out)

    monkeypatch.setattr(tierkv.quant, "decode_into", one_by_one)

    def fetch(start: int, stop: int, consume, into) -> set[int]:
        assert sys.getswitchinterval() <= LOAD_SWITCH_INTERVAL_S  # the whole load, copies too
        return consume([(i - start, 0, received[i]) for i in range(start, stop)])

    before = caches[0][:, n + 8].clone()
    assert mover.load(list(range(n, 2 * n)), fetch, batch_blocks=n) == {8}
    assert torch.equal(caches[0][:, n + 8], before)  # never written
    assert sorted(alone) == sorted([len(payloads[3]), len(payloads[8])])  # the odd ones out
    for layer, cache in enumerate(caches):
        for i in range(n):
            if i != 8:
                restored = cache[:, n + i].contiguous().view(torch.uint16).numpy()
                assert np.array_equal(restored, expected[i][layer]), (layer, i)


def test_countdown_runs_once_on_the_last_call():
    calls: list[int] = []
    tick = countdown(3, lambda: calls.append(1))
    tick()
    tick()
    assert calls == []
    tick()
    assert calls == [1]
    countdown(0, lambda: calls.append(2))
    assert calls == [1, 2]


def worker_round_trip_ops(vault, n: int, block_first: bool) -> tuple[int, int]:
    """Torch operations of the vLLM worker storing n blocks and loading them back (a sync load,
    so it runs on this thread) through a real vault; K/V-first or block-first layers (whose
    lossless payloads are received in place)."""
    pytest.importorskip("vllm")
    from tierkv.backends.vault import VaultClient
    from tierkv.connectors.vllm.groups import GroupPlan
    from tierkv.connectors.vllm.scheduler import GroupLoad, LoadJob, StoreJob, TierKVMetadata
    from tierkv.connectors.vllm.worker import TierWorker
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    plan = GroupPlan(0, "kv", ("layer0", "layer1"), (), 4, (bytes(16),))
    shape = (2 * n, 2, 4, 2, 8) if block_first else (2, 2 * n, 4, 2, 8)
    caches = {name: torch.randn(shape).to(torch.bfloat16) for name in plan.layer_names}
    block = (lambda cache, ids: cache[ids]) if block_first else (lambda cache, ids: cache[:, ids])
    tier = ColdTier(get_codec("none"), {"kv": VaultClient(vault.address)})
    worker = TierWorker(tier, [plan], tp_rank=0, staging_bytes=1 << 22)
    try:
        worker.register_kv_caches(caches, num_blocks=2 * n)
        keys = [(n << 32 | i).to_bytes(16, "big") for i in range(n)]
        stores = [StoreJob(0, i, key) for i, key in enumerate(keys)]
        with CountOps() as store_ops:
            worker.store_blocks(TierKVMetadata(stores=stores))
        assert tier.flush(30)
        load = LoadJob("req", [GroupLoad(0, keys, list(range(n, 2 * n)))], sync=True)
        with CountOps() as load_ops:
            worker.start_loads(TierKVMetadata(loads=[load]))
        assert worker.stats.data["loaded_blocks"] == n
        for cache in caches.values():
            assert torch.equal(block(cache, slice(n, None)), block(cache, slice(None, n)))
    finally:
        worker.shutdown()
        tier.close()
    return store_ops.count, load_ops.count


@pytest.mark.parametrize("block_first", [False, True], ids=["kv-first", "block-first"])
def test_the_vllm_worker_issues_as_many_torch_ops_for_few_blocks_as_for_many(vault, block_first):
    few = worker_round_trip_ops(vault, 3, block_first)
    assert few == worker_round_trip_ops(vault, 150, block_first)


def test_a_load_receives_lossless_payloads_straight_into_block_first_engine_blocks(
    vault, monkeypatch: pytest.MonkeyPatch
):
    """Block-first layers (vLLM CPU's layout): the bulk path receives each lossless payload's
    body straight into its engine block; one whose checksum fails, or whose header is not this
    block's (a valid payload as long, of fp16), is reported failed."""
    from tierkv.backends.vault import VaultClient
    from tierkv.checksum import block_checksum
    from tierkv.movers import hand_over
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    n = 10
    caches = [torch.randn(2 * n, 2, 4, 16).to(torch.bfloat16) for _ in range(2)]
    mover = BlockMover(
        [[(cache, 0) for cache in caches]], StagingRing(1 << 22), StagingRing(1 << 22)
    )
    namespace, keys = b"p" * 16, [(7 << 32 | i).to_bytes(16, "big") for i in range(n)]
    tier = ColdTier(get_codec("none"), {"kv": VaultClient(vault.address)})
    try:
        staged = mover.store(list(range(n)))
        assert staged is not None

        def send(index, part, array, dtype, on_done) -> None:
            tier.store(namespace, keys[index], part, array, dtype, on_done=on_done)

        hand_over(staged, mover.codec_dtypes, send)
        assert tier.flush(30)
        payload = vault.store.held()[(namespace, keys[3], 0)]
        flip_byte(vault.store, (namespace, keys[3], 0), len(payload) // 2)  # its checksum fails
        fp16 = get_codec("none").encode(np.zeros((2, 2, 4, 16), np.float16), "fp16")
        assert len(fp16) == len(payload)
        vault.store.put(namespace, keys[5], 0, fp16, block_checksum(namespace, keys[5], 0, fp16))
        copied: list[int] = []
        scatter_lossless = BlockMover._scatter_lossless
        monkeypatch.setattr(
            BlockMover,
            "_scatter_lossless",
            lambda self, ids, blocks: (
                copied.extend(b[0] for b in blocks) or scatter_lossless(self, ids, blocks)
            ),
        )

        def fetch(start, stop, consume, into) -> set[int]:
            return tier.load_blocks(namespace, keys[start:stop], {"kv": [0]}, consume, into)

        assert mover.load(list(range(n, 2 * n)), fetch, batch_blocks=n) == {3, 5}
        assert copied == []  # every payload was placed, none copied from a receive buffer
        for cache in caches:
            for i in range(n):
                if i not in (3, 5):
                    assert torch.equal(cache[n + i], cache[i])
        assert tier.stats()["loaded_payload_bytes"] == (n - 2) * len(payload)
    finally:
        tier.close()


def test_a_vllm_worker_store_step_drops_what_the_full_staging_ring_cannot_hold(vault):
    """The engine thread's store step never waits for staging: with the ring full it returns
    at once and counts every block dropped; with room for some, it stores those and drops the
    rest."""
    pytest.importorskip("vllm")
    import threading

    from tierkv.backends.vault import VaultClient
    from tierkv.connectors.vllm.groups import GroupPlan
    from tierkv.connectors.vllm.scheduler import StoreJob, TierKVMetadata
    from tierkv.connectors.vllm.worker import TierWorker
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    plan = GroupPlan(0, "kv", ("layer0", "layer1"), (), 4, (bytes(16),))
    caches = {name: torch.randn(2, 12, 4, 2, 8).to(torch.bfloat16) for name in plan.layer_names}
    tier = ColdTier(get_codec("int8"), {"kv": VaultClient(vault.address)})
    block_bytes = 2 * 2 * 4 * 2 * 8 * 2
    worker = TierWorker(tier, [plan], tp_rank=0, staging_bytes=4 * block_bytes)
    try:
        worker.register_kv_caches(caches, num_blocks=12)
        ring = worker._movers[0].store_ring
        held = ring.take(ring.nbytes)  # the ring is full (blocks the tier still encodes)
        assert held is not None
        stores = [StoreJob(0, i, (9 << 32 | i).to_bytes(16, "big")) for i in range(6)]
        step = threading.Thread(target=worker.store_blocks, args=(TierKVMetadata(stores=stores),))
        step.start()
        step.join(30)
        assert not step.is_alive(), "the store step waited for staging"
        assert worker.stats.data["staging_dropped_blocks"] == 6
        assert worker.stats.data.get("stored_blocks", 0) == 0
        assert tier.stats()["queued_blocks"] == 0
        held.release()
        worker.store_blocks(TierKVMetadata(stores=stores))
        assert worker.stats.data["staging_dropped_blocks"] == 6 + 2
        assert worker.stats.data["stored_blocks"] == 4
        assert tier.flush(30)
        assert tier.stats()["acknowledged_blocks"] == 4
    finally:
        worker.shutdown()
        tier.close()


@pytest.mark.parametrize("name", ["int8", "tq3.5", "kv4"])
def test_a_restore_through_the_batched_torch_decode_equals_one_through_host_decode(vault, name):
    """The same blocks restored from a real vault twice: with the Numba host decode (the CPU's
    path) and with the batched torch decode (the device path, here on the CPU): the same bits,
    the first block (with sink tokens, a longer payload) included."""
    from tierkv.backends.vault import VaultClient
    from tierkv.movers import hand_over
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    n = 12
    caches = [torch.randn(3 * n, 16, 2, 64).to(torch.bfloat16) for _ in range(2)]
    mover = BlockMover(
        [[(cache, 0) for cache in caches]], StagingRing(1 << 22), StagingRing(1 << 22)
    )
    namespace, keys = b"b" * 16, [(11 << 32 | i).to_bytes(16, "big") for i in range(n)]
    tier = ColdTier(get_codec(name, 64), {"kv": VaultClient(vault.address)})
    try:
        staged = mover.store(list(range(n)))
        assert staged is not None

        def send(index, part, array, dtype, on_done) -> None:
            tier.store(
                namespace,
                keys[index],
                part,
                array,
                dtype,
                on_done=on_done,
                kv_split=(3, 32),  # [layers, tokens, heads, K | V]
                sink_tokens=(1, 4 if index == 0 else 0),
            )

        hand_over(staged, mover.codec_dtypes, send)
        assert tier.flush(30)

        def fetch(start, stop, consume, into) -> set[int]:
            return tier.load_blocks(namespace, keys[start:stop], {"kv": [0]}, consume, into)

        host, batched = list(range(n, 2 * n)), list(range(2 * n, 3 * n))
        assert mover.load(host, fetch, batch_blocks=5) == set()
        assert mover.load(batched, fetch, batch_blocks=5, on_device=True) == set()
        for cache in caches:
            assert torch.equal(cache[n : 2 * n].view(torch.int16), cache[2 * n :].view(torch.int16))
            assert not torch.equal(cache[n : 2 * n], cache[:n])  # lossy: decoded, not copied
    finally:
        tier.close()


def test_the_start_up_measurement_of_device_decode_says_why_and_frees_its_staging():
    from tierkv.movers import device_decode_pays
    from tierkv.quant import get_codec
    from tierkv.quant.codec import encode_block

    caches = [torch.randn(40, 16, 2, 64).to(torch.bfloat16) for _ in range(2)]
    mover = BlockMover(
        [[(cache, 0) for cache in caches]], StagingRing(1 << 22), StagingRing(1 << 22)
    )
    codec = get_codec("kv4", 64)
    pays, why = device_decode_pays(
        mover, lambda block: encode_block(codec, block, "bf16", kv_split=(3, 32))
    )
    assert isinstance(pays, bool)
    assert "32 blocks" in why and why.count("GB/s") == 2
    assert mover.store_ring.largest_free() == mover.store_ring.nbytes
    assert mover.load_ring.largest_free() == mover.load_ring.nbytes
