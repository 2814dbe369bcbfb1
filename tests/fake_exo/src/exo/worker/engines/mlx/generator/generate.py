"""Test fixture: the request flow of EXO's `mlx_generate`, reduced to greedy decoding of token ids.

Like EXO: ask the prefix cache for a cache and the tokens still to prefill, prefill all but the
last two of them (EXO prefills all but the last one, then rolls the cache back by two), then
decode starting from the last two prompt tokens. Where the cache is stored follows the release,
told apart by what `get_kv_cache` returns: EXO >= v1.0.70 (a 4-tuple) stores it with
`add_kv_cache(prompt, cache, media_regions=...)` before decoding; v1.0.68-v1.0.69 (a 3-tuple)
after decoding, under the prompt and the generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from exo.worker.engines.mlx.cache import KVPrefixCache, make_kv_cache
from exo.worker.engines.mlx.vision import MediaRegion


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    """The greedy (argmax) tokens generated."""
    prefilled: int
    """Prompt tokens the model computed (the rest came from a cache)."""


def mlx_generate(
    model: Any,
    prompt_tokens: mx.array,
    kv_prefix_cache: KVPrefixCache | None,
    max_tokens: int,
    media_regions: list[MediaRegion] | None = None,
) -> Generation:
    """Greedy tokens for `prompt_tokens`; `media_regions` marks image tokens, as EXO's vision
    path passes them to the prefix cache (EXO >= v1.0.70)."""
    media = {"media_regions": media_regions} if media_regions is not None else {}
    if kv_prefix_cache is None:
        caches, remaining, store_first = make_kv_cache(model), prompt_tokens, False
    else:
        found = kv_prefix_cache.get_kv_cache(model, prompt_tokens, **media)
        caches, remaining, store_first = found[0], found[1], len(found) == 4
    prefill, feed = remaining[:-2], remaining[-2:]
    if len(prefill) > 0:
        model(prefill[None], cache=caches)
        mx.eval([(c.keys, c.values) for c in caches])
    if kv_prefix_cache is not None and store_first:
        kv_prefix_cache.add_kv_cache(prompt_tokens, caches, **media)
    tokens: list[int] = []
    for _ in range(max_tokens):
        logits = model(feed[None], cache=caches)[0, -1]
        tokens.append(int(mx.argmax(logits).item()))
        feed = mx.array(tokens[-1:])
    if kv_prefix_cache is not None and not store_first:
        everything = mx.concatenate([prompt_tokens, mx.array(tokens, dtype=prompt_tokens.dtype)])
        kv_prefix_cache.add_kv_cache(everything, caches)
    return Generation(tokens, len(remaining))
