"""Test fixture: a per-process prompt cache with the shape of EXO's `KVPrefixCache` (>= v1.0.70).

Written for the tierkv tests (not EXO's code). It keeps EXO's names and conventions, which are
what tierkv's hook relies on:
- `KVPrefixCache(group)` stores the distributed group as `self._group`;
- parallel lists `prompts` (token arrays), `caches` (lists of mlx-lm cache layers, deep copies)
  and `_last_used` (LRU counters);
- `get_kv_cache(model, prompt_tokens)` -> (cache, remaining tokens, matched index, is_exact);
  an exact hit keeps len(prompt) - 1 tokens so the caller always has a token to feed;
- `add_kv_cache(prompt_tokens, cache)` calls `_evict_if_needed()` first, which pops LRU entries
  (`prompts.pop(i)`, `caches.pop(i)`) while memory use is above `_MEMORY_THRESHOLD`
  (`EXO_MEMORY_THRESHOLD=0` evicts every entry).
"""

from __future__ import annotations

import os
from copy import deepcopy
from typing import Any

import mlx.core as mx
import psutil
from mlx_lm.models.cache import KVCache

_MEMORY_THRESHOLD = float(os.environ.get("EXO_MEMORY_THRESHOLD", "0.85"))


def make_kv_cache(model: Any) -> list[Any]:
    """A fresh cache for every layer of `model` (the model's own kinds when it has make_cache)."""
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


def cache_length(cache: list[Any]) -> int:
    """Tokens held by the longest layer of a cache."""
    return max((getattr(c, "offset", 0) for c in cache), default=0)


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
        self._last_used: list[int] = []
        self._access_counter = 0
        self._group = group

    def add_kv_cache(self, prompt_tokens: mx.array, cache: list[Any]) -> None:
        """Store a copy of `cache` for `prompt_tokens`, evicting LRU entries first if needed."""
        self._evict_if_needed()
        self.prompts.append(prompt_tokens)
        self.caches.append(deepcopy(cache))
        self._access_counter += 1
        self._last_used.append(self._access_counter)

    def update_kv_cache(self, index: int, prompt_tokens: mx.array, cache: list[Any]) -> None:
        """Replace entry `index` in place."""
        self.prompts[index] = prompt_tokens
        self.caches[index] = deepcopy(cache)
        self._access_counter += 1
        self._last_used[index] = self._access_counter

    def get_kv_cache(
        self, model: Any, prompt_tokens: mx.array
    ) -> tuple[list[Any], mx.array, int | None, bool]:
        """The best cached prefix of `prompt_tokens`, trimmed, and the tokens left to prefill."""
        total = len(prompt_tokens)
        best_index: int | None = None
        best_length = 0
        is_exact = False
        for i, cached_prompt in enumerate(self.prompts):
            length = get_prefix_length(prompt_tokens, cached_prompt)
            if length >= total - 1:
                best_index, best_length, is_exact = i, length, True
                break
            if length > best_length:
                best_index, best_length = i, length
        if best_index is None:
            return make_kv_cache(model), prompt_tokens, None, False

        cached = cache_length(self.caches[best_index])
        keep = min(cached, total - 1 if is_exact else best_length)
        prompt_cache = deepcopy(self.caches[best_index])
        if cached > keep:
            for c in prompt_cache:
                c.trim(cached - keep)
                c.offset = keep
        self._access_counter += 1
        self._last_used[best_index] = self._access_counter
        return prompt_cache, prompt_tokens[keep:], best_index, is_exact

    def _evict_if_needed(self) -> None:
        """Drop least-recently-used entries while memory use is above the threshold."""
        while self.caches and self.get_memory_used_percentage() > _MEMORY_THRESHOLD:
            lru = self._last_used.index(min(self._last_used))
            self.prompts.pop(lru)
            self.caches.pop(lru)
            self._last_used.pop(lru)

    def get_memory_used_percentage(self) -> float:
        """System memory in use, 0..1 (the highest of all ranks in a distributed group)."""
        local = psutil.virtual_memory().percent / 100
        if self._group is None:
            return local
        every = mx.distributed.all_gather(mx.array([local]), group=self._group)
        return float(mx.max(every).item())
