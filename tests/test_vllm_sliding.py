"""Sliding-window models through the cold tier on a real vLLM CPU engine and a real vault.

The model is a tiny Gemma 3 (`build_tiny_gemma3`): five sliding-window layers of WINDOW tokens
and one full-attention layer, which vLLM keeps in six KV-cache groups of one layer each (five
sliding-window groups, one full-attention group). Prompts span several windows: a restore loads
the full-attention layer's blocks for the whole prefix and each window layer's blocks for the
window before the hit end only, where vLLM's own prefix-cache hit has its null blocks in front.

The engines run in spawned processes, driven as in test_vllm_connector. The vault is a
`tierkv vault` process, so the last test can kill it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import VaultHandle, pick_free_port, start_subprocess_vault
from test_vllm_connector import Engine, prompt
from tiny_models import GEMMA3_WINDOW, build_tiny_gemma3

from tierkv.vault.client import VaultClient

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


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    assert GEMMA3_WINDOW != WINDOW  # the other model differs in its window only
    return {
        "gemma3": build_tiny_gemma3(root / "gemma3", seed=0, window=WINDOW),
        "other_window": build_tiny_gemma3(root / "gemma3-window", seed=0),
    }


@pytest.fixture(scope="module")
def vault(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VaultHandle]:
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
def extra(vault: VaultHandle) -> dict[str, Any]:
    return {"cluster.kv_cold": vault.address}


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


def test_killed_vault_gives_the_cold_tokens(engine: Engine, vault: VaultHandle):
    """Last in this module: with the vault killed, an evicted prompt is recomputed to the
    tokens of its cold run."""
    tokens = prompt(5, PROMPT_TOKENS)
    cold = engine.generate(tokens)
    for filler in fillers(5):
        engine.generate(filler)
    assert engine.call("flush")
    vault.kill()
    before = engine.stats()

    assert engine.generate(tokens) == cold

    after = engine.stats()
    assert delta(after, before, "loaded_blocks") == 0
