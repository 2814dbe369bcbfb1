"""Sliding-window models through the cold tier on a real vLLM CPU engine and a real vault.

The model is a tiny Gemma 3 (`build_tiny_gemma3`): five sliding-window layers of WINDOW tokens
and one full-attention layer, which vLLM keeps in six KV-cache groups of one layer each (five
sliding-window groups, one full-attention group). Prompts span several windows: a restore loads
the full-attention layer's blocks for the whole prefix and each window layer's blocks for the
window before the hit end only, where vLLM's own prefix-cache hit has its null blocks in front.

The engines run in spawned processes, driven as in test_vllm_connector. Their vault is a
`tierkv vault` process (`engine_vault`), so the last test can kill it. The first tests check the
plans and the hit rule without an engine, against a real in-process vault.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import VaultHandle, pick_free_port, start_subprocess_vault, wait_until
from test_vllm_connector import Engine, prompt
from test_vllm_parts import attention, fake_request, fake_vllm_config, kv_cache_config
from tiny_models import GEMMA3_WINDOW, build_tiny_gemma3

from tierkv.backends.vault import VaultClient
from tierkv.checksum import block_checksum
from tierkv.keys import chain_block_keys

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 32  # vLLM CPU's attention block
WINDOW = 4 * BLOCK
WINDOW_LAYERS = 5
GEMMA3_ENGINE = {"block_size": BLOCK, "max_model_len": 1024, "kv_cache_memory_bytes": 2_000_000}
"""About 240 blocks, shared by the six groups; a block of one layer is 32 tokens x 1 KV head x
(64 K + 64 V) x bf16 = 8 KiB."""
BLOCK_BYTES = BLOCK * 1 * (64 + 64) * 2
PROMPT_TOKENS = 600  # almost five windows


def fillers(seed: int) -> list[list[int]]:
    return [prompt(seed * 100 + i, 900) for i in range(3)]


def hit_blocks(tokens: list[int]) -> int:
    """Blocks a restore of `tokens` offers: every full block but vLLM's last token's."""
    return (len(tokens) - 1) // BLOCK


def window_blocks(hit: int) -> int:
    """Blocks of a window layer inside the window before a hit of `hit` blocks (vLLM's rule)."""
    return hit - max(0, hit * BLOCK - WINDOW + 1) // BLOCK


def delta(after: dict[str, Any], before: dict[str, Any], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


def sliding_window(window: int, block_size: int = 32) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        sliding_window=window,
    )


# ---- plans and the hit rule, no engine -------------------------------------------------------


def test_every_groups_namespace_covers_the_window_and_the_group_layout():
    """Another window, or vLLM's disable_sliding_window (all groups full attention), with the
    same model and config: no group of one can restore what the other stored, the
    full-attention group included, whose layer sees what the window layers below it made."""
    from tierkv.connectors.vllm.groups import plan_groups

    def namespaces(*specs: Any) -> list[bytes]:
        plans = plan_groups(fake_vllm_config(), kv_cache_config(*specs), "none")
        return [plan.namespaces[0] for plan in plans]

    window, full = plan_groups(
        fake_vllm_config(), kv_cache_config(sliding_window(128), attention()), "none"
    )
    assert (window.window, full.window) == (128, 0)
    assert (window.window_start(18), window.window_start(3), full.window_start(18)) == (14, 0, 0)
    layouts = [
        namespaces(sliding_window(128), attention()),
        namespaces(sliding_window(64), attention()),
        namespaces(attention(), attention()),
    ]
    assert namespaces(sliding_window(128), attention()) == layouts[0]  # stable
    assert len({namespace for layout in layouts for namespace in layout}) == 6


def test_a_hit_is_the_longest_end_every_group_can_restore(vault):
    """Full attention needs the whole prefix, a window group only the blocks inside its window
    before the end: a missing window block moves the hit back to an end whose window the vault
    holds; vLLM's null blocks in front of the window are never loaded into."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from tierkv.connectors.vllm.groups import plan_groups
    from tierkv.connectors.vllm.scheduler import TierScheduler
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    window, full = plan_groups(
        fake_vllm_config(), kv_cache_config(sliding_window(8, 4), attention(4)), "none"
    )
    tokens = list(range(41))  # ten full blocks, then vLLM's last token
    keys = chain_block_keys(tokens, 4)
    payload = get_codec("none").encode(np.zeros(8, "float16"))

    def hold(plan: Any, indices: range | list[int]) -> None:
        namespace = plan.namespaces[0]
        for index in indices:
            checksum = block_checksum(namespace, keys[index], 0, payload)
            vault.store.put(namespace, keys[index], 0, payload, checksum)

    tier = ColdTier(get_codec("none"), {"kv": VaultClient(vault.address)})
    scheduler = TierScheduler(
        tier, [window, full], store_mode="evict", eviction_watermark_blocks=8, num_engine_blocks=64
    )

    def hit(request_id: str, computed: int = 0) -> int:
        request = fake_request(tokens, request_id=request_id, num_tokens=41, block_hashes=[])
        answers: list[tuple[int | None, bool]] = []

        def answered() -> bool:
            answers.append(scheduler.get_num_new_matched_tokens(request, computed))
            return answers[-1][0] is not None

        assert wait_until(answered, 10)
        return answers[-1][0] // 4

    try:
        hold(full, range(10))
        assert hit("no window") == 0
        hold(window, [5, 6, 8])  # the window of an end of 7 blocks, and one block of 10's
        assert hit("window of 7") == 7
        hold(window, [9])
        assert hit("window of 10") == 10
        assert hit("vLLM holds 9 blocks", computed=9 * 4) == 1  # the window's 9th block is vLLM's

        null = KVCacheBlock(0, is_null=True)
        blocks = KVCacheBlocks(
            ([null] * 8 + [KVCacheBlock(i) for i in (31, 32)], [KVCacheBlock(i) for i in range(10)])
        )
        scheduler.update_state_after_alloc(
            fake_request(tokens, request_id="window of 10"), blocks, 10 * 4
        )
        loads = {load.group_id: load for load in scheduler.build_connector_meta().loads[0].groups}
        assert (loads[0].keys, loads[0].block_ids) == (keys[8:10], [31, 32])
        assert (loads[1].keys, loads[1].block_ids) == (keys[:10], list(range(10)))
    finally:
        scheduler.shutdown()
        tier.close()


def test_window_blocks_a_running_request_lets_go_of_are_stored_that_step(vault):
    """vLLM frees a window group's blocks as the window moves past them (a long prefill's chunk
    boundaries, the first decode step), to the tail of its free queue: far from the head the
    eviction walk watches, and with store = "on_finish" no longer the request's at its end. A
    later hit's window ends before the prompt's, so it needs them: they are stored in the step
    they leave, once; the blocks the request still holds and the full-attention ones are not."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash

    from tierkv.connectors.vllm.groups import GroupPlan
    from tierkv.connectors.vllm.scheduler import StoreJob, TierScheduler
    from tierkv.quant import get_codec
    from tierkv.tier import ColdTier

    window = GroupPlan(0, "kv", ("window",), (), 4, (bytes(16),), window=8)
    full = GroupPlan(1, "kv", ("full",), (), 4, (bytes([1] * 16),))
    tier = ColdTier(get_codec("none"), {"kv": VaultClient(vault.address)})
    scheduler = TierScheduler(
        tier,
        [window, full],
        store_mode="on_finish",
        eviction_watermark_blocks=2,
        num_engine_blocks=32,
    )
    pool = BlockPool(32, enable_caching=True, hash_block_size=4)
    scheduler.bind_block_pool(pool)
    tokens = list(range(20))
    hashes = [BlockHash(bytes([index])) for index in range(5)]
    request = fake_request(
        tokens, request_id="long", num_tokens=20, num_computed_tokens=20, block_hashes=hashes
    )
    keys = chain_block_keys(tokens, 4)
    try:
        assert wait_until(
            lambda: scheduler.get_num_new_matched_tokens(request, 0)[0] is not None, 10
        )
        blocks = {}
        for plan in (window, full):
            blocks[plan.group_id] = pool.get_new_blocks(5)
            pool.cache_full_blocks(request, blocks[plan.group_id], 0, 5, 4, plan.group_id)  # type: ignore[arg-type]
        pool.free_blocks(blocks[0][:3])  # what vLLM's remove_skipped_blocks does
        stores = scheduler.build_connector_meta().stores
        assert stores == [
            StoreJob(0, blocks[0][i].block_id, keys[i], first=i == 0) for i in range(3)
        ]
        assert scheduler.build_connector_meta().stores == []  # once
    finally:
        scheduler.shutdown()
        tier.close()


# ---- a tiny Gemma 3 on vLLM CPU ------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    assert GEMMA3_WINDOW != WINDOW  # the other model differs in its window only
    return {
        "gemma3": build_tiny_gemma3(root / "gemma3", seed=0, window=WINDOW),
        "other_window": build_tiny_gemma3(root / "gemma3-window", seed=0),
    }


@pytest.fixture(scope="module")
def engine_vault(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VaultHandle]:
    port = pick_free_port()
    process, _ = start_subprocess_vault(port, "1GiB", "kv_cold", tmp_path_factory.mktemp("vault"))
    handle = VaultHandle(address=f"127.0.0.1:{port}", port=port, process=process)
    client = VaultClient(handle.address, deadline_s=1.0)
    try:
        assert client.wait_ready(60), "vault did not start"
    finally:
        client.close()
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def extra(engine_vault: VaultHandle) -> dict[str, Any]:
    return {"cluster.kv_cold": engine_vault.address}


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], extra: dict[str, Any]) -> Iterator[Engine]:
    started = Engine(models["gemma3"], extra, GEMMA3_ENGINE)
    yield started
    started.close()


def own_prefix_hit(engine: Engine, tokens: list[int]) -> list[int]:
    """The greedy tokens of `tokens` run twice in a row: the second run is vLLM's own
    prefix-cache hit (the connector is asked about no block)."""
    engine.generate(tokens)
    before = engine.stats()
    tokens_out = engine.generate(tokens)
    after = engine.stats()
    assert delta(after, before, "lookup_hit_blocks") == 0
    assert delta(after, before, "lookup_miss_blocks") == 0
    return tokens_out


def test_window_layers_store_and_restore_only_their_window(engine: Engine):
    """After eviction the prompt is restored to the tokens of vLLM's own prefix-cache hit; the
    full-attention layer restores the whole prefix, each window layer its window only, and the
    window layers stored no more than their windows."""
    tokens = prompt(1, PROMPT_TOKENS)
    before_cold = engine.stats()
    hit_tokens = own_prefix_hit(engine, tokens)
    for filler in fillers(1):
        engine.generate(filler)
    assert engine.call("flush")
    before = engine.stats()

    assert engine.generate(tokens) == hit_tokens

    after = engine.stats()
    hit, window = hit_blocks(tokens), window_blocks(hit_blocks(tokens))
    assert window < hit
    assert delta(after, before, "lookup_hit_blocks") == hit  # hit * BLOCK tokens restored
    assert delta(after, before, "loaded_blocks") == hit + WINDOW_LAYERS * window
    assert delta(after, before, "loaded_window_blocks") == WINDOW_LAYERS * window
    assert delta(after, before, "loaded_window_bytes") == WINDOW_LAYERS * window * BLOCK_BYTES
    full_bytes = delta(after, before, "loaded_bytes") - delta(after, before, "loaded_window_bytes")
    assert full_bytes == hit * BLOCK_BYTES
    assert after["load_failed_blocks"] == 0
    # Stored on eviction meanwhile: blocks of the prompt and of the fillers vLLM let go of.
    # The window layers stored at most their windows of each prompt, the full layer more.
    stored = delta(before, before_cold, "stored_blocks")
    stored_window = delta(before, before_cold, "stored_window_blocks")
    prompts = [tokens, *fillers(1)]
    assert 0 < stored_window <= WINDOW_LAYERS * sum(window_blocks(hit_blocks(p)) for p in prompts)
    assert stored - stored_window > stored_window / WINDOW_LAYERS
    assert delta(before, before_cold, "stored_window_bytes") == stored_window * BLOCK_BYTES
    print(f"stored {stored} blocks, {stored_window} of window layers; restored {hit} blocks")


def test_restored_window_blocks_decide_the_tokens(engine: Engine):
    """Control: noise in the restored blocks changes the tokens."""
    tokens = prompt(2, PROMPT_TOKENS)
    cold = engine.generate(tokens)
    for filler in fillers(2):
        engine.generate(filler)
    assert engine.call("flush")
    engine.call("scramble_loads")
    assert engine.generate(tokens) != cold


def test_fresh_engine_process_restores_the_windows(
    models: dict[str, Path], engine: Engine, extra: dict[str, Any]
):
    """A new engine process restores what only the first one computed, windows included."""
    tokens = prompt(3, PROMPT_TOKENS)
    hit_tokens = own_prefix_hit(engine, tokens)
    for filler in fillers(3):
        engine.generate(filler)
    assert engine.call("flush")
    fresh = Engine(models["gemma3"], extra, GEMMA3_ENGINE)
    try:
        assert fresh.generate(tokens) == hit_tokens
        stats = fresh.stats()
    finally:
        fresh.close()
    hit = hit_blocks(tokens)
    assert stats["lookup_hit_blocks"] == hit
    assert stats["loaded_blocks"] == hit + WINDOW_LAYERS * window_blocks(hit)
    assert stats["loaded_window_bytes"] == WINDOW_LAYERS * window_blocks(hit) * BLOCK_BYTES


def test_a_model_with_another_window_misses(
    models: dict[str, Path], engine: Engine, extra: dict[str, Any]
):
    """The same weights with another window: nothing the first engine stored is offered."""
    tokens = prompt(4, PROMPT_TOKENS)
    engine.generate(tokens)
    for filler in fillers(4):
        engine.generate(filler)
    assert engine.call("flush")
    other = Engine(models["other_window"], extra, GEMMA3_ENGINE)
    try:
        other.generate(tokens)
        stats = other.stats()
    finally:
        other.close()
    assert stats["lookups"] >= 1 and stats["lookup_hits"] == 0
    assert stats["loaded_blocks"] == 0


def test_killed_vault_gives_the_cold_tokens(engine: Engine, engine_vault: VaultHandle):
    """Last in this module: with the vault killed, an evicted prompt is recomputed to the
    tokens of its cold run."""
    tokens = prompt(5, PROMPT_TOKENS)
    cold = engine.generate(tokens)
    for filler in fillers(5):
        engine.generate(filler)
    assert engine.call("flush")
    engine_vault.kill()
    before = engine.stats()

    assert engine.generate(tokens) == cold

    after = engine.stats()
    assert delta(after, before, "loaded_blocks") == 0
