"""Which KV-cache groups vLLM CPU's attention lays out otherwise than their shape, and how.

vLLM CPU's backend (CPU_ATTN) allocates [blocks, heads, tokens, 2 × head_size] and its kernel
views a head's block as [2 × tokens, head_size], keys (in a packing of the kernel's ISA) then
values; see tierkv.real_axes. GPU backends keep K and V on an axis of 2 and are left alone. The
order is not assumed: the kernel that writes the cache (`cpu_attn_reshape_and_cache`, with the
ISA vLLM picks for the dtype, block and head size) writes a block whose every value is its own
index, a base-256 digit at a time (exact in bf16), and where each value lands is the order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from tierkv.logs import get_logger
from tierkv.real_axes import RealAxes

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from tierkv.connectors.vllm.groups import GroupPlan

log = get_logger(__name__)

CPU_ATTN = "CPU_ATTN"
"""vLLM's name of its CPU attention backend."""


def cpu_attn_groups(vllm_config: VllmConfig, plans: Sequence[GroupPlan]) -> list[GroupPlan]:
    """The attention plans whose every layer runs vLLM's CPU attention backend."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    found = []
    for plan in plans:
        if plan.is_state:
            continue
        kind = cast(type[Any], AttentionLayerBase)  # abstract: mypy wants a concrete class
        layers = get_layers_from_vllm_config(vllm_config, kind, plan.layer_names)
        names = {layer.get_attn_backend().get_name() for layer in layers.values()}
        if len(layers) == len(plan.layer_names) and names == {CPU_ATTN}:
            found.append(plan)
    return found


def real_axes(
    vllm_config: VllmConfig, plans: Sequence[GroupPlan], kv_caches: Mapping[str, torch.Tensor]
) -> dict[int, RealAxes]:
    """Per group id, the real axes of the blocks of each CPU_ATTN group (none for others).

    The probe calls vLLM internals: where they fail (another vLLM), the group keeps its nominal
    layout, with a warning: lossless blocks are unaffected, lossy codecs lose more accuracy than
    `tierkv eval` measured."""
    found = {}
    for plan in cpu_attn_groups(vllm_config, plans):
        cache = kv_caches[plan.layer_names[0]]
        _, _, tokens, width = cache.shape
        try:
            found[plan.group_id] = probe(cache.dtype, tokens, width // 2)
        except Exception as exc:  # an unknown kernel must not stop the engine
            log.warning(
                "KV group %d: vLLM CPU's block layout could not be probed (%s); lossy codecs "
                "see its nominal axes and lose more accuracy than tierkv eval measured",
                plan.group_id,
                exc,
            )
    return found


def probe(dtype: torch.dtype, tokens: int, head_size: int) -> RealAxes:
    """The order in which vLLM CPU's kernel writes a head's keys and values into its block."""
    # The backend's own ops module: vllm._custom_ops in 0.32, vllm._cpu_ops from 0.34.
    from vllm.v1.attention.backends import cpu_attn

    isa = cpu_attn._get_attn_isa(dtype, tokens, head_size)
    size = 2 * tokens * head_size
    index = np.arange(size).reshape(2, tokens, 1, head_size)  # [K|V, tokens, heads, head_size]
    seen = np.zeros(size, np.int64)
    slots = torch.arange(tokens, dtype=torch.long)
    digits = max(1, -(-(size - 1).bit_length() // 8))
    for digit in range(digits):
        values = torch.from_numpy((index >> (8 * digit)) & 0xFF).to(dtype)
        cache = torch.full((1, 1, 2 * tokens, head_size), -1.0, dtype=dtype)
        keys, vals = cache.chunk(2, dim=2)
        cpu_attn.ops.cpu_attn_reshape_and_cache(values[0], values[1], keys, vals, slots, isa)
        seen += cache.reshape(-1).to(torch.int64).numpy() << (8 * digit)
    if not np.array_equal(np.sort(seen), np.arange(size)):
        raise ValueError(
            f"tierkv: vLLM CPU's attention ({isa}) does not write a {dtype} block of {tokens} "
            f"tokens × {head_size} as a permutation of its keys and values; lossy codecs "
            "cannot hand it over (use codec none)"
        )
    order = np.empty(size, np.int64)
    order[seen] = np.arange(size)
    return RealAxes(order, tokens, head_size)
