"""What tierkv stores for each of vLLM's KV-cache groups, under which namespace, in which vault.

Shared by the scheduler side and the worker side, which must agree on it byte for byte: a group's
plan names its vault ("kv" for full and sliding-window attention, "ssm" for Mamba /
linear-attention state), the window of a sliding-window group, the parts stored per block (one per
layer, or one per layer and state tensor) and one namespace per tensor-parallel rank. The
namespace fingerprints everything that makes stored bytes incompatible, the whole group layout
(every group's kind, window and layers) included, so any difference between two engines is a
cache miss, never a wrong block.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from tierkv.config import KV_VAULT, SSM_VAULT
from tierkv.errors import TierKVError
from tierkv.keys import namespace_fingerprint, weights_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

NAMESPACE_FORMAT = 2
"""Bumped whenever the bytes tierkv stores for a vLLM block change meaning."""


class UnsupportedGroupError(TierKVError, ValueError):
    """A KV-cache group of a kind tierkv cannot store (the connector then runs without the tier)."""

    def __init__(self, group_id: int, kind: str) -> None:
        super().__init__(
            f"tierkv cannot store KV-cache group {group_id} ({kind}); "
            "supported: full attention, sliding window and Mamba / linear-attention state"
        )
        self.group_id = group_id
        self.kind = kind


@dataclass(frozen=True)
class GroupPlan:
    """How one KV-cache group's blocks are stored."""

    group_id: int
    vault: str
    """"kv" (attention KV) or "ssm" (recurrent state: only the state at the hit end is loaded)."""
    layer_names: tuple[str, ...]
    state_layout: tuple[tuple[tuple[int, ...], str], ...]
    """Mamba groups: (shape, torch dtype name) of each state tensor packed in a block's page,
    in order; empty for attention, whose block is treated as one opaque array per layer."""
    block_size: int
    namespaces: tuple[bytes, ...]
    """One per tensor-parallel rank."""
    kv_widths: tuple[int, int] = (0, 0)
    """Attention: (keys, values) values per token and head, keys first along a block's last
    axis (vLLM's [..., head_size | head_size_v]); what a K/V pair codec splits on."""
    window: int = 0
    """Sliding-window groups: how many tokens up to the next one vLLM keeps (its sliding_window
    plus extra_retained_tokens); 0 for full attention and state groups."""

    def window_start(self, end_block: int) -> int:
        """The first block a hit of `end_block` blocks needs of this group: vLLM keeps, and
        attends to, only the blocks holding the window before the next token (the earlier
        ones are its null blocks); 0 for a group that needs the whole prefix."""
        if not self.window:
            return 0
        return max(0, end_block * self.block_size - self.window + 1) // self.block_size

    @property
    def states_per_layer(self) -> int:
        return max(1, len(self.state_layout))

    @property
    def parts(self) -> range:
        """Part ids of one block: one per state tensor (a single one for attention), each
        holding that tensor's block of every layer of the group, stacked. One payload per block
        and state keeps the per-payload cost (RPC entries, decode tasks) independent of depth."""
        return range(self.states_per_layer)

    @property
    def is_state(self) -> bool:
        return self.vault == SSM_VAULT


def plan_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, codec_name: str
) -> list[GroupPlan]:
    """One plan per prefix-cacheable group; raises UnsupportedGroupError for a group of a kind
    tierkv cannot store, ValueError for groups of different block sizes."""
    from vllm import __version__ as vllm_version
    from vllm.platforms import current_platform
    from vllm.v1 import kv_cache_interface
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    # Full-attention subclasses whose blocks are not the KV of one whole prefix: R-SWA drops a
    # gap of blocks between the prompt and the decode window (null blocks mid-prefix), sink
    # attention keeps its sink tokens apart. Refused (fail open) rather than stored as full.
    not_full = tuple(
        getattr(kv_cache_interface, name)
        for name in ("RSWASpec", "SinkFullAttentionSpec")
        if hasattr(kv_cache_interface, name)
    )

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    base = {
        "format": NAMESPACE_FORMAT,
        "model": model_config.model,
        "revision": model_config.revision,
        "model_config": _config_hash(model_config.hf_config),
        "weights": model_fingerprint(model_config.model, model_config.revision),
        "vllm": ".".join(vllm_version.split(".")[:2]),
        "device": current_platform.device_type,
        "layout_env": os.environ.get("VLLM_KV_CACHE_LAYOUT"),
        "cache_dtype": vllm_config.cache_config.cache_dtype,
        "codec": codec_name,
        "tp_size": parallel.tensor_parallel_size,
        "pp_size": parallel.pipeline_parallel_size,
        # A layer's KV depends on every layer below it: a window or a group kind that differs
        # anywhere (another checkpoint, vLLM's disable_sliding_window) changes every group's.
        "layout": [
            [list(group.layer_names), repr(group.kv_cache_spec)]
            for group in kv_cache_config.kv_cache_groups
        ],
    }
    plans = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not spec.prefix_cacheable:
            continue
        kv_widths, window = (0, 0), 0
        if isinstance(spec, MambaSpec):
            vault = SSM_VAULT
            states = tuple(
                (tuple(shape), str(dtype).removeprefix("torch."))
                for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
            )
        elif isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)) and not isinstance(
            spec, not_full
        ):
            vault, states = KV_VAULT, ()
            kv_widths = (spec.head_size, spec.head_size_v)
            if isinstance(spec, SlidingWindowSpec):
                window = spec.sliding_window + spec.extra_retained_tokens
        else:
            raise UnsupportedGroupError(group_id, type(spec).__name__)
        namespaces = tuple(
            namespace_fingerprint({**base, "group": group_id, "tp_rank": rank})
            for rank in range(parallel.tensor_parallel_size)
        )
        plans.append(
            GroupPlan(
                group_id=group_id,
                vault=vault,
                layer_names=tuple(group.layer_names),
                state_layout=states,
                block_size=spec.block_size,
                namespaces=namespaces,
                kv_widths=kv_widths,
                window=window,
            )
        )
    if len({plan.block_size for plan in plans}) > 1:
        sizes = {plan.group_id: plan.block_size for plan in plans}
        raise ValueError(f"tierkv needs one block size across KV-cache groups, got {sizes}")
    return plans


def blockwise_load_failures(plans: Sequence[GroupPlan], num_groups: int) -> bool:
    """Whether vLLM may be told of failed loads block by block (its invalid block ids), which a
    load before the forward (synchronous) also needs: only with one KV-cache group in all
    (block ids are not unique across groups, and vLLM refuses per-block errors with several)
    and that group full attention. vLLM then keeps the prefix before the first failed block and
    recomputes from there; in a sliding-window group that recompute would attend to vLLM's null
    blocks where its window reaches back before the restored ones. Otherwise a failed load fails
    its whole request, which vLLM recomputes from its own hit."""
    return num_groups == 1 and len(plans) == 1 and not plans[0].window


def model_fingerprint(model: str, revision: str | None = None) -> str | None:
    """`weights_fingerprint` of the model's directory: `model` itself, or its snapshot in the
    Hugging Face cache (vLLM has downloaded it before the connector starts; nothing is fetched)."""
    if os.path.isdir(model):
        return weights_fingerprint(model)
    try:
        from huggingface_hub import snapshot_download

        return weights_fingerprint(
            snapshot_download(model, revision=revision, local_files_only=True)
        )
    except Exception:  # not a cached hub model: the name and revision are all there is
        return None


def _config_hash(hf_config: object) -> str:
    """A stable hash of the model's Hugging Face config."""
    to_dict = getattr(hf_config, "to_dict", None)
    data = to_dict() if callable(to_dict) else vars(hf_config)
    canonical = json.dumps(data, sort_keys=True, default=str)
    return xxhash.xxh3_64_hexdigest(canonical.encode())
