"""Test fixture: a per-process prompt cache that behaves like EXO's `KVPrefixCache` (v1.0.70+).

Written for the tierkv tests from reading EXO's cache.py (not EXO's code). It keeps EXO's names,
signatures and behaviour where tierkv's hook meets them:
- `KVPrefixCache(group)` stores the distributed group as `self._group`;
- parallel lists, one item per entry: `prompts` (token arrays), `caches` (lists of mlx-lm cache
  layers, deep copies), `_snapshots` (recurrent-state snapshots or None), `_media_regions`
  (image regions of the prompt), `prefill_tps` and `_last_used` (LRU counters);
- `add_kv_cache(prompt_tokens, cache, ssm_snapshots=None, media_regions=None, prefill_tps=0.0)`
  calls `_evict_if_needed()` first, which pops the LRU entry from every list (`prompts.pop(i)`,
  `caches.pop(i)`, ...) while memory use is above `_MEMORY_THRESHOLD` (`EXO_MEMORY_THRESHOLD=0`
  evicts every entry), then collects garbage and clears MLX's buffer cache;
- `get_kv_cache(model, prompt_tokens, media_regions=None)` -> (cache, remaining tokens, matched
  index, is_exact): the longest common token prefix, cut at the first cached image region whose
  content hash differs from the query's; an exact hit keeps len(prompt) - 1 tokens so the caller
  has a token to feed; an entry holding recurrent state (ArraysCache, RotatingKVCache) is rolled
  back to its nearest snapshot at or before the match, or not used at all without one.
"""

from __future__ import annotations

import gc
import os
from copy import deepcopy
from typing import Any

import mlx.core as mx
import psutil
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from exo.worker.engines.mlx.vision import MediaRegion

_MEMORY_THRESHOLD = float(os.environ.get("EXO_MEMORY_THRESHOLD", "0.85"))


class CacheSnapshot:
    """Recurrent-state layers (None for plain KV layers) as they were after `token_count` tokens."""

    def __init__(self, states: list[Any], token_count: int):
        self.states = states
        self.token_count = token_count


def snapshot_ssm_states(cache: list[Any]) -> CacheSnapshot:
    states = [deepcopy(c) if isinstance(c, ArraysCache | RotatingKVCache) else None for c in cache]
    return CacheSnapshot(states, cache_length(cache))


def has_non_kv_caches(cache: list[Any]) -> bool:
    return any(isinstance(c, ArraysCache | RotatingKVCache) for c in cache)


def make_kv_cache(model: Any) -> list[Any]:
    """A fresh cache for every layer of `model` (the model's own kinds when it has make_cache)."""
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


def cache_length(cache: list[Any]) -> int:
    """Tokens held by the longest layer of a cache."""
    return max((getattr(c, "offset", 0) for c in cache), default=0)


def trim_cache(cache: list[Any], num_tokens: int, snapshot: CacheSnapshot | None) -> None:
    """Drop the last `num_tokens` of every KV layer; recurrent layers go back to the snapshot."""
    for i, layer in enumerate(cache):
        if isinstance(layer, ArraysCache | RotatingKVCache):
            if snapshot is not None and snapshot.states[i] is not None:
                cache[i] = deepcopy(snapshot.states[i])
            else:
                layer.state = [None] * len(layer.state)
        else:
            layer.trim(num_tokens)


def get_prefix_length(prompt: mx.array, cached_prompt: mx.array) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(prompt.shape[0], cached_prompt.shape[0])
    if n == 0:
        return 0
    same = mx.cumprod((prompt[:n] == cached_prompt[:n]).astype(mx.int32))
    return int(same.sum().item())


class KVPrefixCache:
    def __init__(self, group: mx.distributed.Group | None):
        self.prompts: list[mx.array] = []
        self.caches: list[list[Any]] = []
        self._snapshots: list[list[CacheSnapshot] | None] = []
        self._media_regions: list[list[MediaRegion]] = []
        self._last_used: list[int] = []
        self.prefill_tps: list[float] = []
        self._access_counter = 0
        self._group = group

    def add_kv_cache(
        self,
        prompt_tokens: mx.array,
        cache: list[Any],
        ssm_snapshots: list[CacheSnapshot] | None = None,
        media_regions: list[MediaRegion] | None = None,
        prefill_tps: float = 0.0,
    ) -> None:
        """Store a copy of `cache` for `prompt_tokens`, evicting LRU entries first if needed."""
        self._evict_if_needed()
        self.prompts.append(prompt_tokens)
        self.caches.append(deepcopy(cache))
        self._snapshots.append(ssm_snapshots)
        self._media_regions.append(media_regions or [])
        self.prefill_tps.append(prefill_tps)
        self._access_counter += 1
        self._last_used.append(self._access_counter)

    def get_kv_cache(
        self,
        model: Any,
        prompt_tokens: mx.array,
        media_regions: list[MediaRegion] | None = None,
    ) -> tuple[list[Any], mx.array, int | None, bool]:
        """The best cached prefix of `prompt_tokens`, trimmed, and the tokens left to prefill."""
        total = len(prompt_tokens)
        best_index: int | None = None
        best_length = 0
        is_exact = False
        for i, cached_prompt in enumerate(self.prompts):
            length = get_prefix_length(prompt_tokens, cached_prompt)
            if length > 0:
                length = self._validate_media_match(
                    length, self._media_regions[i], media_regions or []
                )
            if length >= total - 1:
                best_index, best_length, is_exact = i, length, True
                break
            if length > best_length:
                best_index, best_length = i, length
        if best_index is None:
            return make_kv_cache(model), prompt_tokens, None, False

        cached = cache_length(self.caches[best_index])
        recurrent = has_non_kv_caches(self.caches[best_index])
        # Recurrent state cannot be cut back to the match: it resumes from a snapshot there.
        target = best_length if recurrent else min(cached, total - 1 if is_exact else best_length)
        keep, snapshot = self._get_snapshot(best_index, target)
        if recurrent and snapshot is None:
            return make_kv_cache(model), prompt_tokens, None, False
        prompt_cache = deepcopy(self.caches[best_index])
        if cached > keep:
            trim_cache(prompt_cache, cached - keep, snapshot)
            for layer in prompt_cache:
                if hasattr(layer, "offset"):
                    layer.offset = keep
        self._access_counter += 1
        self._last_used[best_index] = self._access_counter
        return prompt_cache, prompt_tokens[keep:], best_index, is_exact

    def _get_snapshot(self, index: int, target: int) -> tuple[int, CacheSnapshot | None]:
        """Where entry `index` can resume: `target` for plain KV; else its nearest snapshot."""
        if not has_non_kv_caches(self.caches[index]):
            return target, None
        usable = [s for s in self._snapshots[index] or [] if s.token_count <= target]
        if not usable:
            return 0, None
        nearest = max(usable, key=lambda s: s.token_count)
        return nearest.token_count, nearest

    @staticmethod
    def _validate_media_match(
        length: int, cached: list[MediaRegion], query: list[MediaRegion]
    ) -> int:
        """Cut a token match at the first cached image region the query holds other content in."""
        query_at = {region.start_pos: region for region in query}
        for region in cached:
            if region.start_pos >= length:
                break
            other = query_at.get(region.start_pos)
            if other is not None and other.content_hash != region.content_hash:
                return region.start_pos
        return length

    def _evict_if_needed(self) -> None:
        """Drop least-recently-used entries while memory use is above the threshold."""
        evicted = False
        while self.caches and self.get_memory_used_percentage() > _MEMORY_THRESHOLD:
            lru = self._last_used.index(min(self._last_used))
            self.prompts.pop(lru)
            self.caches.pop(lru)
            self._snapshots.pop(lru)
            self._media_regions.pop(lru)
            self._last_used.pop(lru)
            self.prefill_tps.pop(lru)
            evicted = True
        if evicted:
            gc.collect()
            mx.clear_cache()

    def get_memory_used_percentage(self) -> float:
        """System memory in use, 0..1 (the highest of all ranks in a distributed group)."""
        local = psutil.virtual_memory().percent / 100
        if self._group is None:
            return local
        every = mx.distributed.all_gather(mx.array([local]), group=self._group)
        return float(mx.max(every).item())
