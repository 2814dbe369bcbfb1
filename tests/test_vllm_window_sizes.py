"""Sliding-window models at the sizes users run: restores at least the engine's own prefix hit.

A tiny random-weight Gemma 3 (`build_tiny_gemma3`: five sliding-window layers to one full
attention layer) for each window Gemma 3 and gpt-oss ship (128, 512, 1024), on vLLM CPU blocks
of 16 tokens (vLLM's GPU default) and 128 (its CPU default), with prompts from below the window
to 8k tokens. One engine per (window, block) shape runs every prompt: its cold run, vLLM's own
prefix-cache hit (the same prompt again), then, with `store = "on_finish"` and vLLM's prefix
cache reset, the restore from a real vault. The restore must bring back at least the tokens of
vLLM's own hit and generate the tokens of that hit.

vLLM frees a window layer's blocks as the window moves past them, during a long prefill and at
the first decode step; a finished request then hands only its last window's blocks to the
connector, while a later hit of the same prompt needs the window before its own (earlier) end.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_vllm_connector import Engine, prompt
from test_vllm_sliding import delta
from tiny_models import build_tiny_gemma3

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SHAPES = [(window, block) for window in (128, 512, 1024) for block in (16, 128)] + [(0, 128)]
"""(window, block); window 0: the same model with six full-attention layers, as the reference
of what a window saves at 8k tokens."""
LONGEST = 8192
ENGINE = {"max_model_len": LONGEST + 16, "kv_cache_memory_bytes": 24 << 20}
"""A block of one layer is 1 KV head x (64 K + 64 V) x bf16 = 256 bytes a token: 24 MiB hold
one 8k prompt in all six layers, with room for vLLM's chunked prefill."""
WINDOW_LAYERS = 5
RESULTS_ENV = "TIERKV_WINDOW_RESULTS"
"""Where to append each shape's rows as JSON lines (docs/sliding-window.md's table)."""


def prompt_lengths(window: int, block: int) -> list[int]:
    """Below the window, the window itself, two blocks past it (the first block of the window
    before vLLM's hit end is freed at the first decode step), one and a half windows off the
    block grid, then 3000 and 8192 tokens (prefilled in chunks)."""
    if not window:
        return [LONGEST]
    beyond = (window + 2 * block, window + window // 2 + block // 2 + 1)
    return sorted({window // 2, window, *beyond, 3000, LONGEST})


@pytest.fixture(scope="module")
def vault_address() -> Iterator[str]:
    from tierkv.vault.server import serve

    server = serve("127.0.0.1:0", 0, role="kv_cold")
    yield f"127.0.0.1:{server.port}"
    server.stop(grace=0.5)


@pytest.fixture(
    scope="module",
    params=SHAPES,
    ids=[f"window{w}-block{b}" if w else f"full-block{b}" for w, b in SHAPES],
)
def shaped(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vault_address: str
) -> Iterator[tuple[int, int, Engine]]:
    window, block = request.param
    model = build_tiny_gemma3(
        tmp_path_factory.mktemp(f"gemma3-{window}"),
        seed=0,
        window=window or 128,
        window_layers=WINDOW_LAYERS if window else 0,
    )
    extra = {"cluster.kv_cold": vault_address, "connector.store": "on_finish"}
    engine = Engine(model, extra, {**ENGINE, "block_size": block})
    yield window, block, engine
    engine.close()


def test_restores_at_least_the_engines_own_hit(shaped: tuple[int, int, Engine]):
    window, block, engine = shaped
    rows = []
    for seed, length in enumerate(prompt_lengths(window, block)):
        tokens = prompt(7000 + seed, length)
        cold, started = engine.stats(), time.perf_counter()
        engine.call("generate_cached", tokens)  # cold: stored when it finishes
        before_hit = engine.stats()
        hit_tokens, cached = engine.call("generate_cached", tokens)
        # vLLM's own hit: what it found in its prefix cache, not what tierkv added to it
        own_hit = cached - block * delta(engine.stats(), before_hit, "lookup_hit_blocks")
        assert engine.call("flush")
        assert engine.call("reset_prefix_cache")
        before = engine.stats()
        restored_tokens, restored = engine.call("generate_cached", tokens)
        after = engine.stats()
        rows.append(
            {
                "window": window,
                "block": block,
                "prompt": length,
                "own_hit": own_hit,
                "restored": restored,
                "identical": restored_tokens == hit_tokens,
                "stored_bytes": delta(before, cold, "stored_bytes"),
                "stored_window_bytes": delta(before, cold, "stored_window_bytes"),
                "restored_bytes": delta(after, before, "loaded_bytes"),
                "restored_window_bytes": delta(after, before, "loaded_window_bytes"),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    for row in rows:
        print(row)
    if path := os.environ.get(RESULTS_ENV):
        with Path(path).open("a") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
    assert all(row["own_hit"] > 0 for row in rows if row["prompt"] > block)
    assert [row["restored"] >= row["own_hit"] for row in rows] == [True] * len(rows), rows
    assert all(row["identical"] for row in rows), rows


def test_a_fresh_engine_restores_the_window_and_a_dead_vault_is_cold(
    tmp_path_factory: pytest.TempPathFactory,
):
    """Window 512 on 128-token blocks, 3000 tokens: a new engine process restores what only the
    first one computed, at least vLLM's own hit and its tokens; with the vault stopped, the
    prompt is recomputed to its cold tokens."""
    from tierkv.vault.server import serve

    server = serve("127.0.0.1:0", 0, role="kv_cold")
    model = build_tiny_gemma3(tmp_path_factory.mktemp("gemma3-fresh"), seed=0, window=512)
    extra = {"cluster.kv_cold": f"127.0.0.1:{server.port}", "connector.store": "on_finish"}
    settings = {**ENGINE, "block_size": 128}
    tokens = prompt(7100, 3000)
    try:
        first = Engine(model, extra, settings)
        try:
            cold, _ = first.call("generate_cached", tokens)
            before = first.stats()
            hit_tokens, cached = first.call("generate_cached", tokens)
            own_hit = cached - 128 * delta(first.stats(), before, "lookup_hit_blocks")
            assert first.call("flush")
        finally:
            first.close()
        fresh = Engine(model, extra, settings)
        try:
            restored_tokens, restored = fresh.call("generate_cached", tokens)
            assert restored >= own_hit > 0
            assert restored_tokens == hit_tokens
            assert fresh.call("reset_prefix_cache")
            server.stop(grace=0)
            before = fresh.stats()
            assert fresh.call("generate_cached", tokens) == (cold, 0)
            assert delta(fresh.stats(), before, "loaded_blocks") == 0
        finally:
            fresh.close()
    finally:
        server.stop(grace=0)
