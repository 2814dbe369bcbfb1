"""Pieces of the vLLM connector that need no engine: settings, keys of a request, statistics."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from helpers import wait_until

from tierkv.config import ConfigError, Endpoint
from tierkv.connectors.vllm.connector import connector_config
from tierkv.connectors.vllm.scheduler import request_keys
from tierkv.connectors.vllm.stats import TierKVStats
from tierkv.keys import chain_block_keys


def test_settings_inline_or_from_a_file(tmp_path: Path):
    inline = connector_config({"cluster.kv_cold": "127.0.0.1:5000", "connector.store": "on_finish"})
    assert inline.cluster.kv_cold == (Endpoint("127.0.0.1:5000"),)
    assert inline.connector.store == "on_finish"
    assert inline.source == "kv_connector_extra_config"

    path = tmp_path / "tierkv.toml"
    path.write_text('[cluster]\nkv_cold = "127.0.0.1:5001"\n')
    assert connector_config({"config_path": str(path)}).cluster.kv_cold == (
        Endpoint("127.0.0.1:5001"),
    )


def test_settings_errors_name_the_bad_thing(tmp_path: Path):
    with pytest.raises(ValueError, match=r"config_path.*cluster"):
        connector_config({"config_path": "x.toml", "cluster": {"kv_cold": "127.0.0.1:1"}})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config.*connector\.store"):
        connector_config({"connector.store": "sometimes"})
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        connector_config({"config_path": str(tmp_path / "missing.toml")})


def fake_request(tokens: list[int], **fields: object) -> SimpleNamespace:
    defaults = {
        "all_token_ids": tokens,
        "prompt_token_ids": tokens,
        "mm_features": [],
        "cache_salt": None,
        "lora_request": None,
    }
    return SimpleNamespace(**(defaults | fields))


def test_request_keys_follow_tokens_salt_and_lora():
    tokens = list(range(100))
    plain = request_keys(fake_request(tokens), 32)
    assert plain == chain_block_keys(tokens, 32)
    salted = request_keys(fake_request(tokens, cache_salt="tenant-a"), 32)
    lora = request_keys(fake_request(tokens, lora_request=SimpleNamespace(lora_name="a")), 32)
    assert salted is not None and lora is not None
    assert len({plain[0], salted[0], lora[0]}) == 3  # none can restore another's KV


def test_requests_whose_tokens_do_not_pin_the_kv_have_no_keys():
    assert request_keys(fake_request([1] * 64, mm_features=[object()]), 32) is None
    assert request_keys(fake_request([0] * 64, prompt_token_ids=None), 32) is None


def test_stats_intervals_and_aggregation():
    stats = TierKVStats()
    assert stats.take_interval() is None
    stats.observe_lookup(hit_blocks=3, asked_blocks=5, seconds=0.002)
    stats.add("loaded_blocks", 3)
    interval = stats.take_interval()
    assert interval is not None and interval.data["lookup_hit_blocks"] == 3
    assert stats.take_interval() is None  # nothing new since
    stats.add("loads")
    stats.add("load_seconds", 0.01)
    other = stats.take_interval()
    assert other is not None
    merged = interval.aggregate(other)
    reduced = merged.reduce()
    assert reduced["lookup_miss_blocks"] == 2 and reduced["loaded_blocks"] == 3
    assert reduced["avg_load_ms"] == pytest.approx(10.0)
    assert "load_seconds" not in reduced


def _connector_prom_metrics(labelnames: list[str], labelvalues: list[object]) -> tuple[Any, Any]:
    """(registry, the connector's metrics in it) for one engine, as vLLM builds them."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from tierkv.connectors.vllm.connector import TierKVConnector

    registry = CollectorRegistry()
    metric_types = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    prom = TierKVConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), metric_types, labelnames, {0: labelvalues}
    )
    return registry, prom


def test_connector_counters_reach_vllms_prometheus_metrics():
    registry, prom = _connector_prom_metrics(["engine"], ["0"])
    stats = TierKVStats()
    stats.add("loaded_blocks", 3)
    stats.add("loaded_bytes", 3 * 4096)
    stats.add("store_dropped_blocks", 2)
    value = functools.partial(registry.get_sample_value, labels={"engine": "0"})
    assert value("vllm:tierkv_load_failed_blocks_total") == 0  # there before the first event
    assert value("vllm:tierkv_cold_tier_off") == 0
    interval = stats.take_interval()
    assert interval is not None
    prom.observe(interval.data, engine_idx=0)
    prom.observe(interval.data, engine_idx=0)
    assert value("vllm:tierkv_loaded_blocks_total") == 6
    assert value("vllm:tierkv_loaded_bytes_total") == 6 * 4096
    assert value("vllm:tierkv_store_dropped_blocks_total") == 4
    assert value("vllm:tierkv_load_failed_blocks_total") == 0
    stats.add("cold_tier_off")
    prom.observe(stats.take_interval().data, engine_idx=0)  # type: ignore[union-attr]
    assert value("vllm:tierkv_cold_tier_off") == 1
    assert value("vllm:tierkv_cold_tier_off_total") is None


def test_worker_stores_and_restores_blocks_of_a_strided_layout(vault):
    """Blocks go out and come back through a real vault, whatever dimension holds the block id
    (here K/V first, so each block is a strided view restored via staging); a block the vault
    lacks is reported as a load error and nothing is written into it."""
    import torch

    from tierkv.backends.vault import VaultClient
    from tierkv.connectors.vllm.groups import GroupPlan
    from tierkv.connectors.vllm.scheduler import GroupLoad, LoadJob, StoreJob, TierKVMetadata
    from tierkv.connectors.vllm.worker import TierWorker
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    plan = GroupPlan(0, "kv", ("layer0", "layer1"), (), 4, (bytes(16),))
    caches = {name: torch.randn(2, 6, 4, 2, 8).to(torch.bfloat16) for name in plan.layer_names}
    tier = ColdTier(get_codec("none"), {"kv": VaultClient(vault.address)})
    worker = TierWorker(tier, [plan], tp_rank=0, staging_bytes=1 << 20)
    try:
        worker.register_kv_caches(caches, num_blocks=6)
        keys = [bytes([i + 1]) * 16 for i in range(3)]
        stores = [StoreJob(0, block_id, key) for block_id, key in zip((1, 2, 3), keys, strict=True)]
        worker.store_blocks(TierKVMetadata(stores=stores))
        assert tier.flush(10)
        stored = {name: cache[:, 1:4].clone() for name, cache in caches.items()}
        for cache in caches.values():
            cache.zero_()

        missing = bytes([9]) * 16
        load = GroupLoad(0, [*keys, missing], [4, 5, 0, 3])
        worker.start_loads(TierKVMetadata(loads=[LoadJob("req", [load])]))
        finished: set[str] = set()

        def loaded() -> bool:
            finished.update(worker.finished_loads()[0])
            return "req" in finished

        wait_until(loaded, 10, interval=0.01)
        assert finished == {"req"}
        assert worker.take_invalid_block_ids() == {3}
        for name, cache in caches.items():
            assert torch.equal(cache[:, [4, 5, 0]], stored[name])
            assert not cache[:, 3].any()
        assert worker.stats.data["loaded_blocks"] == 3
        restored = sum(cache[:, 0].numel() * cache.element_size() for cache in caches.values())
        assert worker.stats.data["loaded_bytes"] == 3 * restored
        assert worker.largest_block_bytes() == restored  # what a warm-up sizes its kernels by
        assert worker.stats.data["load_failed_blocks"] == 1
    finally:
        worker.shutdown()
        tier.close()


def test_a_failed_load_fails_its_whole_request_where_vllm_cannot_recompute_from_the_block():
    """Block by block only with one full-attention group in all: vLLM recomputes from the first
    failed block, which in a sliding-window group would attend to its null blocks, and it
    refuses per-block errors with several groups (one tierkv does not plan included)."""
    from tierkv.connectors.vllm.groups import GroupPlan, blockwise_load_failures

    full = GroupPlan(0, "kv", ("layer0",), (), 4, (bytes(16),))
    window = GroupPlan(0, "kv", ("layer0",), (), 4, (bytes(16),), window=8)
    assert blockwise_load_failures([full], 1)
    assert not blockwise_load_failures([window], 1)
    assert not blockwise_load_failures([full], 2)  # a second group tierkv does not store
    assert not blockwise_load_failures([full, window], 2)


def test_a_sliding_window_load_that_loses_a_block_fails_its_request(vault):
    """A single sliding-window group: the load of a request that loses one block is reported
    failed as a whole (vLLM recomputes it from its own hit), never as that block alone."""
    import torch

    from tierkv.backends.vault import VaultClient
    from tierkv.connectors.vllm.groups import GroupPlan
    from tierkv.connectors.vllm.scheduler import GroupLoad, LoadJob, StoreJob, TierKVMetadata
    from tierkv.connectors.vllm.worker import TierWorker
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    plan = GroupPlan(0, "kv", ("layer0",), (), 4, (bytes(16),), window=8)
    caches = {"layer0": torch.randn(6, 2, 4, 2, 8).to(torch.bfloat16)}
    tier = ColdTier(get_codec("none"), {"kv": VaultClient(vault.address)})
    worker = TierWorker(tier, [plan], tp_rank=0, staging_bytes=1 << 20, num_groups=1)
    try:
        worker.register_kv_caches(caches, num_blocks=6)
        key = bytes([1]) * 16
        worker.store_blocks(TierKVMetadata(stores=[StoreJob(0, 1, key)]))
        assert tier.flush(10)
        load = GroupLoad(0, [key, bytes([9]) * 16], [4, 5])
        worker.start_loads(TierKVMetadata(loads=[LoadJob("req", [load])]))
        finished: set[str] = set()
        failed: set[str] = set()

        def loaded() -> bool:
            done, lost = worker.finished_loads()
            finished.update(done)
            failed.update(lost)
            return "req" in finished

        wait_until(loaded, 10, interval=0.01)
        assert (finished, failed) == ({"req"}, {"req"})
        assert worker.take_invalid_block_ids() == set()
    finally:
        worker.shutdown()
        tier.close()


@contextlib.contextmanager
def one_stored_block(vault: Any, key: bytes) -> Iterator[tuple[Any, dict[str, Any]]]:
    """A TierWorker over a one-layer paged buffer of 6 blocks whose block 1 is stored under
    `key` (acknowledged), and that buffer."""
    import torch

    from tierkv.backends.vault import VaultClient
    from tierkv.connectors.vllm.groups import GroupPlan
    from tierkv.connectors.vllm.scheduler import StoreJob, TierKVMetadata
    from tierkv.connectors.vllm.worker import TierWorker
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    plan = GroupPlan(0, "kv", ("layer0",), (), 4, (bytes(16),))
    caches = {"layer0": torch.randn(6, 2, 4, 2, 8).to(torch.bfloat16)}
    tier = ColdTier(get_codec("none"), {"kv": VaultClient(vault.address)})
    worker = TierWorker(tier, [plan], tp_rank=0, staging_bytes=1 << 20)
    try:
        worker.register_kv_caches(caches, num_blocks=6)
        worker.store_blocks(TierKVMetadata(stores=[StoreJob(0, 1, key)]))
        assert tier.flush(10)
        yield worker, caches
    finally:
        worker.shutdown()
        tier.close()


def test_a_load_before_the_forward_pauses_the_garbage_collector(vault, monkeypatch):
    """A load on the engine thread (nothing else running) skips cyclic collections, which its
    per-block objects would trigger by the dozen; the collector is on again afterwards, and one
    that was off stays off."""
    import gc

    import torch

    from tierkv.connectors.vllm.scheduler import GroupLoad, LoadJob, TierKVMetadata

    key = bytes([7]) * 16
    with one_stored_block(vault, key) as (worker, caches):
        collecting: list[bool] = []
        load_group = worker._load_group

        def watched(load: GroupLoad) -> tuple[set[int], int]:
            collecting.append(gc.isenabled())
            return load_group(load)

        monkeypatch.setattr(worker, "_load_group", watched)

        def sync_load() -> TierKVMetadata:
            return TierKVMetadata(loads=[LoadJob("req", [GroupLoad(0, [key], [2])], True)])

        assert gc.isenabled()
        worker.start_loads(sync_load())
        assert collecting == [False]
        assert gc.isenabled()
        assert torch.equal(caches["layer0"][2], caches["layer0"][1])
        gc.disable()
        try:
            worker.start_loads(sync_load())
            assert not gc.isenabled()
        finally:
            gc.enable()


def test_a_steps_loads_start_once(vault):
    """The connector starts a step's loads in handle_preemptions, before vLLM prepares the
    step's inputs, and vLLM's start_load_kv later hands the same metadata again: the worker
    loads each request once."""
    import torch

    from tierkv.connectors.vllm.scheduler import GroupLoad, LoadJob, TierKVMetadata

    key = bytes([8]) * 16
    with one_stored_block(vault, key) as (worker, caches):
        step = TierKVMetadata(loads=[LoadJob("req", [GroupLoad(0, [key], [2])], True)])
        worker.start_loads(step)
        worker.start_loads(step)
        assert worker.stats.data["loads"] == 1
        assert torch.equal(caches["layer0"][2], caches["layer0"][1])
        worker.start_loads(TierKVMetadata(loads=step.loads))  # the next step's metadata
        assert worker.stats.data["loads"] == 2


def test_worker_drops_what_does_not_fit_the_staging_budget(vault):
    import torch

    from tierkv.backends.vault import VaultClient
    from tierkv.connectors.vllm.groups import GroupPlan
    from tierkv.connectors.vllm.scheduler import StoreJob, TierKVMetadata
    from tierkv.connectors.vllm.worker import TierWorker
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    plan = GroupPlan(0, "kv", ("layer0",), (), 4, (bytes(16),))
    cache = torch.ones(3, 2, 4, 16, dtype=torch.float16)  # 256 bytes per block
    tier = ColdTier(get_codec("none"), {"kv": VaultClient(vault.address)})
    worker = TierWorker(tier, [plan], tp_rank=0, staging_bytes=600)
    try:
        worker.register_kv_caches({"layer0": cache}, num_blocks=3)
        stores = [StoreJob(0, block_id, bytes([block_id + 1]) * 16) for block_id in range(3)]
        worker.store_blocks(TierKVMetadata(stores=stores))
        assert worker.stats.data["stored_blocks"] == 2
        assert worker.stats.data["staging_dropped_blocks"] == 1
    finally:
        worker.shutdown()
        tier.close()


def fake_vllm_config(
    model: str = "org/model", tp: int = 1, layers: int = 2, **transfer: object
) -> SimpleNamespace:
    from vllm.config import KVTransferConfig

    hf_config = SimpleNamespace(to_dict=lambda: {"num_hidden_layers": layers})
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model, revision=None, hf_config=hf_config, dtype="bfloat16"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto", enable_prefix_caching=True),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TierKVConnector",
            kv_role="kv_both",
            kv_load_failure_policy=transfer.pop("policy", "recompute"),
            kv_connector_extra_config=transfer,
        ),
    )


def kv_cache_config(*specs: object):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"g{i}.layer"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def attention(block_size: int = 32, dtype: str = "bfloat16"):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=getattr(torch, dtype)
    )


def test_namespaces_differ_with_everything_that_changes_the_bytes():
    from tierkv.connectors.vllm.groups import plan_groups

    def namespaces(config=None, cache=None, codec="none") -> tuple[bytes, ...]:
        (plan,) = plan_groups(
            config or fake_vllm_config(), cache or kv_cache_config(attention()), codec
        )
        return plan.namespaces

    base = namespaces()
    assert namespaces() == base  # stable: another process computes the same
    variants = [
        namespaces(config=fake_vllm_config(model="org/other")),
        namespaces(config=fake_vllm_config(layers=3)),  # same name, another config
        namespaces(cache=kv_cache_config(attention(block_size=64))),
        namespaces(cache=kv_cache_config(attention(dtype="float16"))),
        namespaces(codec="int8"),
    ]
    assert len({base, *variants}) == 1 + len(variants)
    ranks = namespaces(config=fake_vllm_config(tp=2))
    assert len(set(ranks)) == 2 and base[0] not in ranks


def test_namespace_changes_when_weights_are_replaced_in_place(tmp_path):
    """A fine-tune saved over the same path with the same config must not reuse old KV."""
    from tierkv.connectors.vllm.groups import plan_groups

    weights = tmp_path / "model.safetensors"

    def namespace() -> bytes:
        config = fake_vllm_config(model=str(tmp_path))
        (plan,) = plan_groups(config, kv_cache_config(attention()), "none")
        return plan.namespaces[0]

    weights.write_bytes(bytes(4096))
    before = namespace()
    weights.write_bytes(bytes(4095) + b"\x01")
    assert namespace() != before


def unsupported_attention(block_size: int = 32):
    """A group kind tierkv has no plan for, as a future vLLM spec would be (a fake at the edge)."""
    import torch
    from vllm.v1.kv_cache_interface import AttentionSpec

    @dataclass(frozen=True, kw_only=True)
    class FutureAttentionSpec(AttentionSpec):
        pass

    return FutureAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )


def test_groups_tierkv_cannot_store_are_named():
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        RSWASpec,
        SinkFullAttentionSpec,
    )

    from tierkv.connectors.vllm.groups import UnsupportedGroupError, plan_groups

    shape = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    chunked = ChunkedLocalAttentionSpec(**shape, attention_chunk_size=128)
    # Subclasses of full attention whose blocks are not one whole prefix's KV:
    gapped = RSWASpec(**shape, rswa_window=128)
    sinks = SinkFullAttentionSpec(**shape, sink_len=4)
    for spec in (chunked, gapped, sinks, unsupported_attention()):
        with pytest.raises(UnsupportedGroupError, match=r"group 1 \(") as refused:
            plan_groups(fake_vllm_config(), kv_cache_config(attention(), spec), "none")
        assert (refused.value.group_id, refused.value.kind) == (1, type(spec).__name__)


def test_connector_fails_open_on_a_group_kind_it_cannot_store(caplog):
    """The engine starts without the cold tier (no vault needed), asks it for nothing and says
    so once in its log and in its counters."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tierkv.connectors.vllm.connector import TierKVConnector

    cache = kv_cache_config(attention(), unsupported_attention())
    with caplog.at_level(logging.WARNING, logger="vllm.tierkv"):
        scheduler = TierKVConnector(fake_vllm_config(), KVConnectorRole.SCHEDULER, cache)
    try:
        (line,) = [r.getMessage() for r in caplog.records if r.name.startswith("vllm.tierkv")]
        assert "cold tier off" in line and "FutureAttentionSpec" in line and "org/model" in line
        request = SimpleNamespace(request_id="r0", block_hashes=[], num_tokens=64)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]
        stats = scheduler.get_kv_connector_stats()
        assert stats is not None and stats.data["cold_tier_off"] == 1
    finally:
        scheduler.shutdown()


def test_connector_refuses_settings_that_could_lose_a_request():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tierkv.connectors.vllm.connector import TierKVConnector

    cache = kv_cache_config(attention())
    role = KVConnectorRole.SCHEDULER
    with pytest.raises(ValueError, match="kv_load_failure_policy='recompute'"):
        TierKVConnector(fake_vllm_config(policy="fail"), role, cache)
    without_prefix_caching = fake_vllm_config()
    without_prefix_caching.cache_config.enable_prefix_caching = False
    with pytest.raises(ValueError, match="prefix caching"):
        TierKVConnector(without_prefix_caching, role, cache)
    with pytest.raises(ValueError, match=r"cluster\.kv_cold is not set"):
        TierKVConnector(fake_vllm_config(**{"connector.store": "on_finish"}), role, cache)


def test_tensor_parallel_ranks_store_apart_and_agree_on_the_shortest_hit(vault):
    """Two TierWorkers (ranks 0 and 1 of tensor_parallel_size=2, as vLLM's two TP workers) store
    their own halves of the heads under their rank's namespace; the scheduler offers only the
    prefix every rank holds, and each rank restores its own bytes, never the other's. (vLLM CPU
    is not run with TP=2 here: see the closing note of issue 12.)"""
    import torch

    from tierkv.backends.vault import VaultClient
    from tierkv.connectors.vllm.groups import plan_groups
    from tierkv.connectors.vllm.scheduler import (
        GroupLoad,
        LoadJob,
        StoreJob,
        TierKVMetadata,
        TierScheduler,
    )
    from tierkv.connectors.vllm.worker import TierWorker
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    (plan,) = plan_groups(fake_vllm_config(tp=2), kv_cache_config(attention(block_size=4)), "none")
    assert len(set(plan.namespaces)) == 2
    tokens = list(range(17))
    keys = chain_block_keys(tokens, 4)
    tier = ColdTier(get_codec("none"), {"kv": VaultClient(vault.address)})
    caches = [{"g0.layer": torch.randn(8, 2, 4, 64).to(torch.bfloat16)} for _ in range(2)]
    workers = [TierWorker(tier, [plan], tp_rank=rank, staging_bytes=1 << 20) for rank in (0, 1)]
    scheduler = TierScheduler(
        tier, [plan], store_mode="on_finish", eviction_watermark_blocks=8, num_engine_blocks=8
    )
    try:
        for rank, (worker, cache) in enumerate(zip(workers, caches, strict=True)):
            worker.register_kv_caches(cache, num_blocks=8)
            held = 3 if rank == 0 else 2  # rank 1 lost its third block
            stores = [StoreJob(0, index, keys[index]) for index in range(held)]
            worker.store_blocks(TierKVMetadata(stores=stores))
        assert tier.flush(10)

        request = fake_request(tokens, request_id="r", num_tokens=17, block_hashes=[])
        answers: list[tuple[int | None, bool]] = []

        def answered() -> bool:
            answers.append(scheduler.get_num_new_matched_tokens(request, 0))
            return answers[-1][0] is not None

        assert wait_until(answered, 10)
        assert answers[-1][0] == 2 * 4  # the prefix both ranks hold

        originals = [cache["g0.layer"][:3].clone() for cache in caches]
        for worker, cache in zip(workers, caches, strict=True):
            cache["g0.layer"][4:].zero_()
            load = GroupLoad(0, keys[:3], [4, 5, 6])
            worker.start_loads(TierKVMetadata(loads=[LoadJob("r", [load], sync=True)]))
        for rank, (worker, cache) in enumerate(zip(workers, caches, strict=True)):
            restored = cache["g0.layer"]
            assert torch.equal(restored[4:6], originals[rank][:2])  # its own heads
            assert worker.take_invalid_block_ids() == (set() if rank == 0 else {6})
            assert not restored[6].any() if rank == 1 else torch.equal(restored[6], originals[0][2])
    finally:
        scheduler.shutdown()
        for worker in workers:
            worker.shutdown()
        tier.close()


@pytest.mark.parametrize(
    ("cache_shape", "kv_widths", "split"),
    [
        ((6, 2, 4, 32), (16, 16), (3, 16)),  # vLLM 0.32: [blocks, heads, tokens, K | V]
        ((2, 6, 4, 2, 16), (16, 16), (1, 1)),  # K/V first: [K|V, blocks, heads, tokens, dim]
    ],
)
def test_a_pair_codec_gets_keys_and_values_apart_in_every_layout(
    vault, cache_shape, kv_widths, split
):
    """The worker tells the tier where keys end; the stored payload is a K/V pair split there,
    and it restores into the engine's layout."""
    import torch

    from tierkv.backends.vault import VaultClient
    from tierkv.connectors.vllm.groups import GroupPlan
    from tierkv.connectors.vllm.scheduler import StoreJob, TierKVMetadata
    from tierkv.connectors.vllm.worker import TierWorker
    from tierkv.quant import decode_into, get_codec
    from tierkv.quant.pair import parse_pair
    from tierkv.tier import ColdTier

    plan = GroupPlan(0, "kv", ("layer0", "layer1"), (), 4, (bytes(16),), kv_widths=kv_widths)
    caches = {name: torch.randn(cache_shape).to(torch.bfloat16) for name in plan.layer_names}
    tier = ColdTier(get_codec("k8v4", 16), {"kv": VaultClient(vault.address)})
    worker = TierWorker(tier, [plan], tp_rank=0, staging_bytes=1 << 20)
    try:
        worker.register_kv_caches(caches, num_blocks=6)
        worker.store_blocks(TierKVMetadata(stores=[StoreJob(0, 2, bytes([1]) * 16)]))
        assert tier.flush(10)
    finally:
        worker.shutdown()
        tier.close()
    (payload,) = vault.store.held().values()
    header = parse_pair(payload)[0]
    assert (header.keys, header.values, header.axis, header.keys_count) == ("int8", "tq4", *split)
    block_dim = cache_shape.index(6)
    stored = torch.stack([cache.select(block_dim, 2) for cache in caches.values()])
    restored = torch.empty_like(stored)
    decode_into(payload, restored.view(torch.int16).numpy())
    assert torch.allclose(restored.float(), stored.float(), atol=0.5, rtol=0.2)
    expected = torch.empty_like(stored)
    words = stored.view(torch.int16).numpy()
    decode_into(
        get_codec("k8v4", 16).encode(words, "bf16", split), expected.view(torch.int16).numpy()
    )
    assert torch.equal(restored, expected)


def test_worker_follows_sleep_mode(vault):
    """vLLM 0.33's sleep mode calls unregister_kv_caches before it unmaps the paged buffers and
    restore_kv_caches after wake-up (vLLM CPU 0.32 has no sleep mode, so the worker is driven
    directly): a background load started before is complete when unregister returns; while
    unregistered a store is dropped and a load fails (recomputed); both calls are idempotent,
    and after restore blocks go out and come back again."""
    import torch

    from tierkv.connectors.vllm.scheduler import GroupLoad, LoadJob, StoreJob, TierKVMetadata

    key = bytes([5]) * 16
    with one_stored_block(vault, key) as (worker, caches):
        cache = caches["layer0"]
        worker.start_loads(TierKVMetadata(loads=[LoadJob("before", [GroupLoad(0, [key], [2])])]))
        worker.unregister_kv_caches()
        assert torch.equal(cache[2], cache[1])  # written before the buffers go away
        worker.unregister_kv_caches()
        assert worker.finished_loads() == ({"before"}, set())  # still reported after sleep

        other = bytes([6]) * 16
        worker.store_blocks(TierKVMetadata(stores=[StoreJob(0, 4, other)]))
        assert worker.stats.data["staging_dropped_blocks"] == 1
        asleep = TierKVMetadata(loads=[LoadJob("asleep", [GroupLoad(0, [key], [3])], True)])
        worker.start_loads(asleep)
        assert worker.take_invalid_block_ids() == {3}

        worker.restore_kv_caches()
        worker.restore_kv_caches()
        cache.zero_()  # wake-up maps the buffers back, their contents gone
        awake = TierKVMetadata(loads=[LoadJob("awake", [GroupLoad(0, [key], [3])], True)])
        worker.start_loads(awake)
        assert worker.take_invalid_block_ids() == set()
        assert cache[3].any()
        worker.store_blocks(TierKVMetadata(stores=[StoreJob(0, 3, other)]))
        assert worker.stats.data["stored_blocks"] == 2


def test_a_cache_reset_drops_the_stores_not_yet_sent(vault):
    """vLLM resets the prefix cache (and the connector's) before sleep mode discards the paged
    buffers; stores queued before the reset (a finished request's blocks) must not reach the
    workers after wake-up, when those blocks hold whatever the remapped memory holds."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash

    from tierkv.backends.vault import VaultClient
    from tierkv.connectors.vllm.groups import GroupPlan
    from tierkv.connectors.vllm.scheduler import TierScheduler
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    plan = GroupPlan(0, "kv", ("layer0",), (), 4, (bytes(16),))
    tier = ColdTier(get_codec("none"), {"kv": VaultClient(vault.address)})
    scheduler = TierScheduler(
        tier, [plan], store_mode="on_finish", eviction_watermark_blocks=8, num_engine_blocks=8
    )
    pool = BlockPool(8, enable_caching=True, hash_block_size=4)
    scheduler.bind_block_pool(pool)
    try:
        for reset in (False, True):
            tokens = list(range(10 * reset, 10 * reset + 9))
            hashes = [BlockHash(bytes([reset, 1])), BlockHash(bytes([reset, 2]))]
            request = fake_request(
                tokens, request_id=f"r{reset}", num_tokens=9, block_hashes=hashes
            )
            assert wait_until(
                lambda request=request: (
                    scheduler.get_num_new_matched_tokens(request, 0)[0] is not None
                ),
                10,
            )
            blocks = pool.get_new_blocks(2)
            pool.cache_full_blocks(request, blocks, 0, 2, 4, 0)  # type: ignore[arg-type]
            scheduler.request_finished(request, ([block.block_id for block in blocks],))
            pool.free_blocks(blocks)
            if reset:
                assert pool.reset_prefix_cache()
                scheduler.forget_stored()
            stores = scheduler.build_connector_meta().stores
            assert len(stores) == (0 if reset else 2)
            # the sequence's first block is marked: its first tokens are attention sinks
            assert [job.first for job in stores] == ([] if reset else [True, False])
    finally:
        scheduler.shutdown()
        tier.close()


def test_the_engine_alert_rules_read_series_the_connector_exports():
    """deploy/'s engine rules and their promtool tests name only the connector's series, with
    the labels vLLM gives them (model_name, engine)."""
    from tests.prometheus_files import metric_names, rule_exprs, rule_test_series

    registry, _ = _connector_prom_metrics(["model_name", "engine"], ["llama", "0"])
    exported = {
        (sample.name, frozenset(sample.labels))
        for metric in registry.collect()
        for sample in metric.samples
    }
    engine_series = [
        (name, labels) for name, labels in rule_test_series() if name.startswith("vllm:")
    ]
    assert engine_series
    for name, labels in engine_series:
        keys = frozenset(key for key, _ in labels) - {"job", "instance"}
        assert (name, keys) in exported, f"{name} {sorted(keys)}: not a series of the connector"
    read = {
        name for expr in rule_exprs() for name in metric_names(expr) if name.startswith("vllm:")
    }
    assert read and read <= {name for name, _ in exported}, read


def test_a_sequences_first_block_keeps_its_sink_tokens_lossless(vault):
    """With a sink codec (the kv4 preset), the worker stores a sequence's first block with its
    first SINK_TOKENS tokens lossless, along the token axis of vLLM's CPU layout
    ([blocks, heads, tokens, K|V]), and a later block without; a load restores them exactly."""
    import torch

    from tierkv.backends.vault import VaultClient
    from tierkv.codecs import SINK_TOKENS
    from tierkv.connectors.vllm.groups import GroupPlan
    from tierkv.connectors.vllm.scheduler import GroupLoad, LoadJob, StoreJob, TierKVMetadata
    from tierkv.connectors.vllm.worker import TierWorker
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    plan = GroupPlan(0, "kv", ("layer0",), (), 16, (bytes(16),), kv_widths=(64, 64))
    caches = {"layer0": (torch.randn(6, 2, 16, 128) + torch.randn(128) * 4).to(torch.bfloat16)}
    tier = ColdTier(get_codec("kv4", 64), {"kv": VaultClient(vault.address)})
    worker = TierWorker(tier, [plan], tp_rank=0, staging_bytes=1 << 20, num_groups=1)
    first, later = bytes([1]) * 16, bytes([2]) * 16
    try:
        worker.register_kv_caches(caches, num_blocks=6)
        stores = [StoreJob(0, 1, first, first=True), StoreJob(0, 2, later)]
        worker.store_blocks(TierKVMetadata(stores=stores))
        assert tier.flush(10)
        load = GroupLoad(0, [first, later], [4, 5])
        worker.start_loads(TierKVMetadata(loads=[LoadJob("req", [load])]))
        assert wait_until(lambda: "req" in worker.finished_loads()[0], 10, interval=0.01)
        cache = caches["layer0"]
        sinks = slice(0, SINK_TOKENS)
        assert torch.equal(cache[4][:, sinks], cache[1][:, sinks])  # lossless
        assert not torch.equal(cache[5][:, sinks], cache[2][:, sinks])  # a later block: lossy
        cosine = torch.nn.functional.cosine_similarity(
            cache[4].float().flatten(), cache[1].float().flatten(), dim=0
        )
        assert cosine > 0.99
    finally:
        worker.shutdown()
        tier.close()
