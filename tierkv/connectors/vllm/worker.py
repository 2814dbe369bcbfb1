"""Worker side of the vLLM connector: copies blocks out of the paged KV buffer and loads them back.

Stores: at the start of a step (`handle_preemptions`, before the forward that could overwrite
anything) each block the scheduler picked is copied to host memory as one array holding every
layer's block (one per state tensor for Mamba) and handed to the ColdTier, which encodes and
sends it in the background; the engine block is free again as soon as the copy returns. A step
copies at most `staging_bytes`; what does not fit is dropped and counted.

Loads run on a background thread (or, when the scheduler asks for it because nothing else is
running, before the step's forward): one ColdTier.load per KV-cache group (one Promote per
vault, parallel decode) decodes into host staging arrays that are then copied into the paged
buffer (CPU or GPU, any layout). Blocks that failed are reported through vLLM's load-error
path, so vLLM recomputes them; their bytes are never used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tierkv.connectors.vllm.groups import GroupPlan
from tierkv.connectors.vllm.scheduler import GroupLoad, LoadJob, TierKVMetadata
from tierkv.connectors.vllm.stats import TierKVStats

if TYPE_CHECKING:
    from tierkv.tier import ColdTier

log = logging.getLogger(__name__)

_CODEC_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class _LoadResult:
    req_id: str
    failed_block_ids: set[int]
    blocks: int
    seconds: float
    nbytes: int
    """Bytes restored into the paged buffer."""


class BlockViews:
    """For each part, per layer, a KV tensor and which of its dimensions is the engine block id.

    The CPU backend puts the block first ([blocks, heads, tokens, K|V]); layouts that put it
    elsewhere (e.g. K/V first) work too, their blocks are just strided views.
    """

    def __init__(self, plan: GroupPlan, kv_caches: dict[str, torch.Tensor], num_blocks: int):
        self.plan = plan
        self.parts: list[list[tuple[torch.Tensor, int]]] = [[] for _ in plan.parts]
        for name in plan.layer_names:
            cache = kv_caches[name]
            shape = tuple(getattr(cache, "shape", ()))
            if not isinstance(cache, torch.Tensor) or num_blocks not in shape:
                raise ValueError(
                    f"tierkv: KV cache of layer {name} has shape {shape or type(cache).__name__}; "
                    f"expected one dimension of {num_blocks} blocks"
                )
            if plan.state_layout:
                if shape[0] != num_blocks:
                    raise ValueError(
                        f"tierkv: Mamba cache of layer {name} has shape {shape}; expected "
                        f"its {num_blocks} pages first"
                    )
                for part, state in enumerate(_state_views(cache, plan.state_layout)):
                    self.parts[part].append((state, 0))
            else:
                _codec_dtype(cache.dtype, name)
                self.parts[0].append((cache, shape.index(num_blocks)))

    def layer_blocks(self, part: int, block_id: int) -> list[torch.Tensor]:
        """The block's views of `part`, one per layer, in layer order."""
        return [tensor.select(dim, block_id) for tensor, dim in self.parts[part]]

    def part_bytes(self, part: int) -> int:
        return sum(view.numel() * view.element_size() for view in self.layer_blocks(part, 0))


class TierWorker:
    """Worker-side data movement of the TierKV connector."""

    def __init__(
        self, tier: ColdTier, plans: Sequence[GroupPlan], *, tp_rank: int, staging_bytes: int
    ) -> None:
        self.tier = tier
        self.plans = {plan.group_id: plan for plan in plans}
        self.tp_rank = tp_rank
        self.staging_bytes = staging_bytes
        self.stats = TierKVStats()
        self._views: dict[int, BlockViews] = {}
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tierkv-load")
        self._loading: dict[str, Future[_LoadResult]] = {}
        self._invalid_block_ids: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self._views = {
            group_id: BlockViews(plan, kv_caches, num_blocks)
            for group_id, plan in self.plans.items()
        }

    # ---- stores ----------------------------------------------------------------------------

    def store_blocks(self, meta: TierKVMetadata) -> None:
        """Copy the picked blocks to host memory and hand them to the tier (returns at once)."""
        budget = self.staging_bytes
        for job in meta.stores:
            views = self._views[job.group_id]
            plan = views.plan
            size = sum(views.part_bytes(part) for part in plan.parts)
            if size > budget:
                self.stats.add("staging_dropped_blocks")
                continue
            budget -= size
            namespace = plan.namespaces[self.tp_rank]
            for part in plan.parts:
                stacked = torch.stack(views.layer_blocks(part, job.block_id))  # the copy
                array, dtype = _numpy_view(stacked.to("cpu"))
                self.tier.store(namespace, job.key, part, array, dtype, plan.vault)
            self.stats.add("stored_blocks")
            self.stats.add("stored_bytes", size)

    # ---- loads -----------------------------------------------------------------------------

    def start_loads(self, meta: TierKVMetadata) -> None:
        for job in meta.loads:
            if job.sync:
                self.stats.add("sync_loads")
                self._account(self._load(job))
            else:
                self._loading[job.req_id] = self._loader.submit(self._load, job)

    def _load(self, job: LoadJob) -> _LoadResult:
        started = time.perf_counter()
        failed_block_ids: set[int] = set()
        nbytes = 0
        for load in job.groups:
            try:
                failed, restored = self._load_group(load)
                nbytes += restored
            except Exception:
                log.exception("tierkv: loading request %s failed; recomputing it", job.req_id)
                failed = set(range(len(load.keys)))
            failed_block_ids.update(load.block_ids[index] for index in failed)
        return _LoadResult(
            job.req_id,
            failed_block_ids,
            sum(len(load.keys) for load in job.groups),
            time.perf_counter() - started,
            nbytes,
        )

    def _load_group(self, load: GroupLoad) -> tuple[set[int], int]:
        """Restore one group's blocks; the indices (into load.keys) that failed, and the bytes
        restored.

        Payloads decode into host staging arrays (all layers of a block, stacked), which are
        then copied into the paged buffer; a failed block's staging array is never copied.
        """
        views = self._views[load.group_id]
        plan = views.plan
        staged: dict[tuple[int, int], torch.Tensor] = {}

        def out_for(index: int, part: int) -> np.ndarray:
            layers = views.layer_blocks(part, load.block_ids[index])
            staging = torch.empty((len(layers), *layers[0].shape), dtype=layers[0].dtype)
            staged[index, part] = staging
            return _numpy_view(staging)[0]

        namespace = plan.namespaces[self.tp_rank]
        failed = self.tier.load(namespace, load.keys, {plan.vault: plan.parts}, out_for)
        restored = 0
        for (index, part), staging in staged.items():
            if index not in failed:
                layers = views.layer_blocks(part, load.block_ids[index])
                for layer, block in zip(layers, staging, strict=True):
                    layer.copy_(block)
                restored += staging.numel() * staging.element_size()
        return failed, restored

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids of background loads done since the last call."""
        finished: set[str] = set()
        failed: set[str] = set()
        for req_id, future in list(self._loading.items()):
            if future.done():
                del self._loading[req_id]
                finished.add(req_id)
                if not self._account(future.result()):
                    failed.add(req_id)
        return finished, failed

    def _account(self, result: _LoadResult) -> bool:
        """Count a load; False when the whole request must be reported failed.

        With one KV-cache group, failed blocks are reported individually (vLLM keeps the valid
        prefix); with several, block ids are not unique across groups, so the whole request is
        reported failed and recomputed.
        """
        self.stats.add("loads")
        self.stats.add("load_seconds", result.seconds)
        self.stats.add("loaded_blocks", result.blocks - len(result.failed_block_ids))
        self.stats.add("loaded_bytes", result.nbytes)
        self.stats.add("load_failed_blocks", len(result.failed_block_ids))
        if not result.failed_block_ids:
            return True
        log.warning(
            "tierkv: %d of %d blocks of request %s were not restored (vault unreachable, "
            "blocks evicted or corrupt); vLLM recomputes them",
            len(result.failed_block_ids),
            result.blocks,
            result.req_id,
        )
        if len(self.plans) == 1:
            self._invalid_block_ids |= result.failed_block_ids
            return True
        return False

    def take_invalid_block_ids(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)


def _codec_dtype(dtype: torch.dtype, what: str) -> str:
    try:
        return _CODEC_DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"tierkv: {what} holds {dtype}; supported KV dtypes are bfloat16, float16, float32"
        ) from None


def _numpy_view(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A numpy view of a CPU tensor (bf16 as its 16-bit pattern) and the codec dtype name."""
    dtype = _codec_dtype(tensor.dtype, "a KV block")
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy(), dtype


def _state_views(page: torch.Tensor, layout: Sequence[tuple[tuple[int, ...], str]]):
    """Split a Mamba layer's raw per-block pages into typed state tensors (vLLM packs a layer's
    states back to back in each page, in the order of its MambaSpec)."""
    pages = page.view(page.shape[0], -1)
    offset = 0
    for shape, dtype_name in layout:
        dtype = getattr(torch, dtype_name)
        _codec_dtype(dtype, f"a Mamba state of shape {shape}")
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        yield pages[:, offset : offset + nbytes].view(dtype)
        offset += nbytes
