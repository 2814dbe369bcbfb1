"""Blocks handed to lossy codecs in their real axes (vLLM CPU's attention layout), through a real
vault and the real worker and codecs; the engine test is in test_vllm_real_model.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import wait_until
from tierkv.quant import read_header
from tierkv.real_axes import RealAxes

TOKENS, HEAD = 16, 64


def transposed_keys(tokens: int, head_size: int) -> RealAxes:
    """vLLM CPU's AVX-512 ("vec") layout of a head's block: keys as [head_size, tokens], then
    values as [tokens, head_size] (what tierkv.connectors.vllm.layout.probe finds there)."""
    token, channel = np.meshgrid(np.arange(tokens), np.arange(head_size), indexing="ij")
    keys = channel * tokens + token
    values = tokens * head_size + token * head_size + channel
    return RealAxes(np.concatenate([keys.ravel(), values.ravel()]), tokens, head_size)


def paged(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Paged blocks [blocks, heads, tokens, 2 × head] as the kernel writes keys and values
    [blocks, heads, tokens, head]."""
    blocks, heads, tokens, head = keys.shape
    half = tokens * head
    flat = np.empty((blocks, heads, 2 * half), keys.dtype)
    flat[..., :half] = keys.swapaxes(-1, -2).reshape(blocks, heads, half)
    flat[..., half:] = values.reshape(blocks, heads, half)
    return flat.reshape(blocks, heads, tokens, 2 * head)


def test_a_block_goes_to_its_real_axes_and_back():
    real = transposed_keys(TOKENS, HEAD)
    rng = np.random.default_rng(0)
    keys, values = rng.standard_normal((2, 3, 2, TOKENS, HEAD)).astype(np.float32)
    block = paged(keys, values)
    there = real.to_real_axes(block)
    assert there.shape == (3, 2, 2, TOKENS, HEAD)
    assert np.array_equal(there[:, :, 0], keys) and np.array_equal(there[:, :, 1], values)
    assert np.array_equal(real.from_real_axes(there), block)
    with pytest.raises(ValueError, match="permutation"):
        RealAxes(np.zeros(2 * TOKENS * HEAD, np.int64), TOKENS, HEAD)


def _worker(codec: str, vault, caches, real: bool, group_size: int = 128):
    from tierkv.backends.vault import VaultClient
    from tierkv.connectors.vllm.groups import GroupPlan
    from tierkv.connectors.vllm.worker import TierWorker
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    plan = GroupPlan(0, "kv", tuple(caches), (), TOKENS, (bytes(16),), kv_widths=(HEAD, HEAD))
    tier = ColdTier(get_codec(codec, group_size), {"kv": VaultClient(vault.address)})
    worker = TierWorker(tier, [plan], tp_rank=0, staging_bytes=1 << 22, num_groups=1)
    layouts = {0: transposed_keys(TOKENS, HEAD)} if real else None
    worker.register_kv_caches(caches, num_blocks=6, real=layouts)
    return worker, tier


def _store(worker, tier, stores) -> None:
    from tierkv.connectors.vllm.scheduler import TierKVMetadata

    worker.store_blocks(TierKVMetadata(stores=stores))
    assert tier.flush(10)


def _load(worker, load) -> set[int]:
    """The engine block ids the load reports failed."""
    from tierkv.connectors.vllm.scheduler import LoadJob, TierKVMetadata

    worker.start_loads(TierKVMetadata(loads=[LoadJob("req", [load])]))
    assert wait_until(lambda: "req" in worker.finished_loads()[0], 10, interval=0.01)
    return worker.take_invalid_block_ids()


def _store_and_load(worker, tier, stores, load) -> set[int]:
    _store(worker, tier, stores)
    return _load(worker, load)


def _kv(rng: np.random.Generator, dtype):
    import torch

    keys = rng.standard_normal((6, 2, TOKENS, HEAD)) + rng.standard_normal(HEAD) * 4
    values = rng.standard_normal((6, 2, TOKENS, HEAD))
    cache = torch.from_numpy(paged(keys, values)).to(dtype)
    return keys, values, cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv4_keeps_the_sink_tokens_of_keys_and_values_exact_in_the_kernels_layout(vault, dtype):
    """kv4 on vLLM CPU's layout, group_size 128 with 64-wide heads (the group follows the head):
    the first block's tokens 0..3 come back bit-exact as the kernel reads keys and values; a
    later block's do not (lossy); both stay close."""
    import torch

    from tierkv.codecs import SINK_TOKENS
    from tierkv.connectors.vllm.scheduler import GroupLoad, StoreJob

    _, _, cache = _kv(np.random.default_rng(1), getattr(torch, dtype))
    caches = {"layer0": cache, "layer1": cache.clone()}
    worker, tier = _worker("kv4", vault, caches, real=True)
    assert tier.codec.group_size == HEAD
    first, later = bytes([1]) * 16, bytes([2]) * 16
    try:
        stores = [StoreJob(0, 1, first, first=True), StoreJob(0, 2, later)]
        assert not _store_and_load(worker, tier, stores, GroupLoad(0, [first, later], [4, 5]))
    finally:
        worker.shutdown()
        tier.close()
    real = transposed_keys(TOKENS, HEAD)
    for layer in caches.values():
        words = layer.view(torch.int16 if dtype == "bfloat16" else torch.int32).numpy()
        kv = real.to_real_axes(words)  # [blocks, heads, K|V, tokens, head]
        assert np.array_equal(kv[4, :, :, :SINK_TOKENS], kv[1, :, :, :SINK_TOKENS])
        assert not np.array_equal(kv[5, :, :, :SINK_TOKENS], kv[2, :, :, :SINK_TOKENS])
        assert not np.array_equal(kv[4, :, :, SINK_TOKENS:], kv[1, :, :, SINK_TOKENS:])
        for restored, stored in ((4, 1), (5, 2)):
            cosine = torch.nn.functional.cosine_similarity(
                layer[restored].float().flatten(), layer[stored].float().flatten(), dim=0
            )
            assert cosine > 0.99


def test_k8v4_splits_keys_from_values_in_the_kernels_layout(vault):
    """k8v4: the keys come back at int8's error, the values at 4 bits' (as the kernel reads
    them), and the stored pair is split on the real K|V axis."""
    import torch

    from tierkv.connectors.vllm.scheduler import GroupLoad, StoreJob
    from tierkv.quant.pair import parse_pair

    keys, values, cache = _kv(np.random.default_rng(2), torch.float32)
    worker, tier = _worker("k8v4", vault, {"layer0": cache}, real=True)
    key = bytes([3]) * 16
    try:
        assert not _store_and_load(worker, tier, [StoreJob(0, 1, key)], GroupLoad(0, [key], [4]))
    finally:
        worker.shutdown()
        tier.close()
    (payload,) = vault.store.held().values()
    header = parse_pair(payload)[0]
    assert (header.shape, header.axis, header.keys_count) == ((1, 2, 2, TOKENS, HEAD), 2, 1)
    kv = transposed_keys(TOKENS, HEAD).to_real_axes(cache.numpy())

    def error(restored: np.ndarray, stored: np.ndarray) -> float:
        return float(np.linalg.norm(restored - stored) / np.linalg.norm(stored))

    key_error, value_error = (error(kv[4, :, part], kv[1, :, part]) for part in (0, 1))
    assert np.allclose(kv[1, :, 0], keys[1]) and np.allclose(kv[1, :, 1], values[1])
    assert key_error < 0.01 < value_error < 0.15


def test_a_payload_stored_in_the_nominal_axes_is_a_miss(vault):
    """A lossy block stored by its nominal shape (before the real axes) is not decoded into a
    block in the real axes, nor the other way round: the load reports it failed (recomputed)
    and leaves the engine block alone. Lossless blocks keep the nominal shape and restore."""
    import torch

    from tierkv.connectors.vllm.scheduler import GroupLoad, StoreJob

    for stored_real, loaded_real in ((False, True), (True, False)):
        _, _, cache = _kv(np.random.default_rng(3), torch.float32)
        caches = {"layer0": cache}
        key = bytes([4 + stored_real]) * 16
        worker, tier = _worker("kv4", vault, caches, real=stored_real, group_size=64)
        try:
            _store(worker, tier, [StoreJob(0, 1, key)])
        finally:
            worker.shutdown()
            tier.close()
        before = cache[4].clone()
        worker, tier = _worker("kv4", vault, caches, real=loaded_real, group_size=64)
        try:
            assert _load(worker, GroupLoad(0, [key], [4])) == {4}
        finally:
            worker.shutdown()
            tier.close()
        assert torch.equal(cache[4], before)
    _, _, cache = _kv(np.random.default_rng(4), torch.float32)
    worker, tier = _worker("none", vault, {"layer0": cache}, real=True)
    key = bytes([7]) * 16
    try:
        assert not _store_and_load(worker, tier, [StoreJob(0, 1, key)], GroupLoad(0, [key], [4]))
    finally:
        worker.shutdown()
        tier.close()
    assert torch.equal(cache[4], cache[1])
    assert read_header(vault.store.held()[bytes(16), key, 0]).shape == (1, 2, TOKENS, 128)


def test_a_layout_probe_that_fails_leaves_the_nominal_axes_and_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another vLLM whose kernel the probe cannot call: the engine starts, the group keeps its
    nominal layout, and the log says what lossy codecs lose."""
    import torch

    from tierkv.connectors.vllm import layout

    plan = type("Plan", (), {"group_id": 0, "layer_names": ["layer.0"], "is_state": False})()

    def no_kernel(*_: object) -> RealAxes:
        raise AttributeError("module 'vllm._custom_ops' has no attribute 'cpu_attn_reshape'")

    monkeypatch.setattr(layout, "cpu_attn_groups", lambda config, plans: [plan])
    monkeypatch.setattr(layout, "probe", no_kernel)
    caches = {"layer.0": torch.zeros((4, 2, TOKENS, 2 * HEAD), dtype=torch.bfloat16)}
    with caplog.at_level("WARNING"):
        assert layout.real_axes(None, [plan], caches) == {}  # type: ignore[arg-type]
    assert "could not be probed" in caplog.text and "cpu_attn_reshape" in caplog.text
