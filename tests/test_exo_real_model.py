"""The EXO hook's restore on a trained model (SmolLM2-135M-Instruct, bf16) through mlx-lm.

mlx-lm loads the converted HF folder of tests/real_model.py as it is. As with vLLM
(tests/test_vllm_real_model.py), the lossless restore is held to EXO's own prefix-cache hit at
the same boundary (a whole number of hook blocks), and with the vault gone to the cold run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from helpers import VaultHandle
from test_exo_hook import (  # noqa: F401 (exo_source, stop_runtime: fixtures used here)
    BLOCK,
    READY_TIMEOUT_S,
    evict_everything,
    exo_source,
    has_media_regions,
    start_exo,
    stop_runtime,
)

from tierkv.bench.prompts import long_prompt
from tierkv.connectors.exo import hook

pytestmark = [pytest.mark.mlx, pytest.mark.real_model, pytest.mark.timeout(600)]

PREFIX_BLOCKS = 20
NEW_TOKENS = 8


def test_restore_generates_exos_own_hit_and_without_the_vault_the_cold_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vault: VaultHandle,
    real_model: Path,
    exo_source: Path | None,  # noqa: F811 (the fixture imported above)
) -> None:
    exo = start_exo(tmp_path, monkeypatch, vault.address, exo_source=exo_source)
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    model, tokenizer = mlx_lm.load(str(real_model))
    ids = tokenizer.encode(long_prompt(600, seed=7))
    # EXO >= v1.0.70 keeps len(prompt) - 2 tokens of a prompt, older ones the generated one too
    kept = PREFIX_BLOCKS * BLOCK
    prompt = mx.array(ids[: kept + 2 if has_media_regions(exo) else kept])
    longer = mx.array(ids[: kept + 60])
    generate: Any = exo.generate.mlx_generate

    def stored_prefix_cache() -> Any:
        prefix_cache = exo.cache.KVPrefixCache(None)
        generate(model, prompt, prefix_cache, max_tokens=1)
        assert {layer.offset for layer in prefix_cache.caches[0]} == {kept}
        return prefix_cache

    hit = generate(model, longer, stored_prefix_cache(), max_tokens=NEW_TOKENS)
    assert hit.prefilled == len(longer) - kept
    cold = generate(model, longer, None, max_tokens=NEW_TOKENS)

    spilled = stored_prefix_cache()
    evict_everything(exo, monkeypatch, spilled)
    assert runtime.flush(30)
    restored = generate(model, longer, spilled, max_tokens=NEW_TOKENS)
    assert restored.prefilled == len(longer) - kept  # the whole prefix came from the vault
    assert restored.tokens == hit.tokens

    lost = stored_prefix_cache()
    evict_everything(exo, monkeypatch, lost)
    runtime.flush(30)
    vault.stop()  # the spilled blocks die with it
    recomputed = generate(model, longer, lost, max_tokens=NEW_TOKENS)
    assert recomputed.prefilled == len(longer)
    assert recomputed.tokens == cold.tokens
    print(f"hit {'==' if hit.tokens == cold.tokens else '!='} cold")
