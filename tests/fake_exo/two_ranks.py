"""One rank of a two-rank EXO-shaped run (started by `mlx.launch -n 2`, ring backend on loopback).

Each rank binds a pipeline shard of its own (rank r holds global layers 2r and 2r+1, so the ranks
store different parts), spills an evicted prompt, then asks for a longer prompt twice:
1. rank 1's lookup finds only three blocks: both ranks must restore the three blocks they agree on;
2. rank 1's lookup raises: both ranks must recompute everything;
3. rank 0 runs a plain model whose load loses the last block, rank 1 one with sliding-window
   layers (restored at the agreed point or not at all): both ranks must recompute everything.
Then each rank binds a tensor shard of its own (the model sharded over both ranks with mlx-lm's
`shard`, so each rank's cache holds one of the two KV heads of every layer), spills a prompt and
restores it (4.) into an empty prompt cache, where the hook reads the geometry from the model.
Prints one JSON line per rank: what each request prefilled and its tokens, and a cold run's.
Configuration comes from TIERKV_CONFIG (a vault on loopback); with TIERKV_EXO_SRC, EXO's prompt
cache is that real checkout's (see real_exo.py), else the fixture package's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent.parent))

from fake_exo.real_exo import FIXTURE_SRC, RealExoFinder
from fake_exo.tiny_mlx import random_tokens, tiny_gemma3, tiny_llama
from tierkv.connectors.exo import boot, hook

READY_TIMEOUT_S = 280  # as in test_exo_hook.py


def main() -> None:
    group = mx.distributed.init()
    rank = group.rank()
    boot.arm()
    if real := os.environ.get("TIERKV_EXO_SRC"):
        sys.meta_path.insert(1, RealExoFinder(Path(real)))  # behind the hook's finder
    else:
        sys.path.insert(0, str(FIXTURE_SRC))
    from exo.worker.engines.mlx import cache as exo_cache
    from exo.worker.engines.mlx.generator.generate import mlx_generate
    from exo.worker.runner.bootstrap import entrypoint

    def bind(kind: str, start_layer: int) -> None:
        """Start a runner through EXO's entry point with a shard of `kind` (binds it)."""
        shard: Any = type(kind, (), {})()
        shard.model_card = SimpleNamespace(model_id="tests/tiny-llama")
        shard.start_layer, shard.end_layer = start_layer, start_layer + 2
        shard.device_rank, shard.world_size = rank, 2
        entrypoint(SimpleNamespace(bound_shard=shard, work=lambda: None), None, None, None, None)

    def spill(model: Any, prompt: mx.array) -> None:
        """Generate for `prompt`, evict its cache (under EXO_MEMORY_THRESHOLD=0) and wait."""
        prefix_cache = exo_cache.KVPrefixCache(group)
        mlx_generate(model, prompt, prefix_cache, max_tokens=1)
        exo_cache._MEMORY_THRESHOLD = 0.0
        prefix_cache._evict_if_needed()
        exo_cache._MEMORY_THRESHOLD = 2.0
        assert runtime.flush(10) and runtime.tier is not None
        mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group))  # both spilled

    bind("PipelineShardMetadata", 2 * rank)
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)

    model = tiny_llama()
    prompt = random_tokens(100, seed=1)
    spill(model, prompt)
    assert runtime.tier is not None

    lookup = runtime.tier.lookup
    if rank == 1:
        runtime.tier.lookup = lambda *args: min(lookup(*args), 3)  # type: ignore[method-assign]

    longer = mx.concatenate([prompt, random_tokens(20, seed=2)])
    cold = mlx_generate(model, longer, None, max_tokens=4)
    partial = mlx_generate(model, longer, exo_cache.KVPrefixCache(group), max_tokens=4)

    if rank == 1:

        def broken_lookup(*args: object) -> int:
            raise ConnectionError("this rank's vault lookup fails")

        runtime.tier.lookup = broken_lookup  # type: ignore[method-assign]
    failed = mlx_generate(model, longer, exo_cache.KVPrefixCache(group), max_tokens=4)

    runtime.tier.lookup = lookup  # type: ignore[method-assign]
    mixed = tiny_llama() if rank == 0 else tiny_gemma3(window=32)
    words = random_tokens(100, seed=5)
    spill(mixed, words)
    load = runtime.tier.load
    if rank == 0:

        def lossy_load(namespace: bytes, keys: list[bytes], *args: Any) -> set[int]:
            return load(namespace, keys, *args) | {len(keys) - 1}

        runtime.tier.load = lossy_load  # type: ignore[method-assign]
    longer_words = mx.concatenate([words, random_tokens(20, seed=6)])
    window = mlx_generate(mixed, longer_words, exo_cache.KVPrefixCache(group), max_tokens=4)
    runtime.tier.load = load  # type: ignore[method-assign]
    window_cold = mlx_generate(mixed, longer_words, None, max_tokens=4)

    bind("TensorShardMetadata", 0)
    sharded = tiny_llama()
    sharded.shard(group)
    text = random_tokens(100, seed=3)
    spill(sharded, text)
    longer_text = mx.concatenate([text, random_tokens(20, seed=4)])
    tensor_cold = mlx_generate(sharded, longer_text, None, max_tokens=4)
    tensor = mlx_generate(sharded, longer_text, exo_cache.KVPrefixCache(group), max_tokens=4)
    result = {
        "rank": rank,
        "cold": [cold.prefilled, cold.tokens],
        "partial": [partial.prefilled, partial.tokens],
        "failed": [failed.prefilled, failed.tokens],
        "window": [window.prefilled, window.tokens, window_cold.tokens],
        "tensor": [tensor.prefilled, tensor.tokens, tensor_cold.tokens],
    }
    print(json.dumps(result), flush=True)
    hook.shutdown()


if __name__ == "__main__":
    main()
