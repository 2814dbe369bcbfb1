"""Worker side of the vLLM connector: moves blocks out of the paged KV buffer and back in.

The data movement itself is tierkv.movers (batched, torch only); this module decides what moves
when and reports to vLLM.

Stores: at the start of a step (`handle_preemptions`, before the forward that could overwrite
anything) the blocks the scheduler picked are gathered, one batch per KV-cache group, into the
host staging ring (on CUDA asynchronously: see tierkv.movers for why no block can be overwritten
before it is copied); once copied, each block's parts (every layer's block, stacked; one part per
state tensor for Mamba) are handed to the ColdTier, which encodes and sends them in the
background and hands the staging back. Blocks that do not fit in the free staging are dropped
and counted.

Loads start right after those copies, before vLLM prepares the step's inputs, on a background
thread (or, when the scheduler asks for it because nothing else is running, right there, before
the step's forward). Per KV-cache group, in batches of up to half the staging, one
ColdTier.load_blocks (Promote runs per vault) hands payloads to the data mover as they arrive:
with the paged buffer on the CPU, lossless ones are received straight into their engine blocks
(blocks-first layouts, vLLM CPU's) or written in at once from the receive buffers; the others
are decoded into staging and one scatter per batch writes them (CPU or GPU, any layout).
Blocks that failed are reported through vLLM's load-error path, so vLLM recomputes them: a
decoded one is left out, so its bytes never reach the paged buffer; a placed one holds whatever
arrived until vLLM's recompute overwrites it, before anything reads it. A request is
reported finished only once its copies have completed. On CUDA with a lossy codec, the
compressed payloads are decoded on the device (one batched decode per batch,
tierkv.quant.torch_batch: only compressed bytes cross PCIe) when a measurement at start says
that beats the host decode (a log line says which and why).

Sleep mode (vLLM 0.33+) unmaps the paged buffers: before it, the worker waits for its loads and
store copies and drops its views; after wake-up it takes them again. In between, a store is
dropped and a load fails (recomputed).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tierkv.codecs import SINK_TOKENS
from tierkv.connectors.vllm.groups import GroupPlan, blockwise_load_failures
from tierkv.connectors.vllm.scheduler import GroupLoad, LoadJob, StoreJob, TierKVMetadata
from tierkv.connectors.vllm.stats import TierKVStats
from tierkv.logs import get_logger
from tierkv.movers import (
    BlockMover,
    Staged,
    StagingRing,
    codec_dtype,
    device_decode_pays,
    hand_over,
)

if TYPE_CHECKING:
    from tierkv.load import Consume
    from tierkv.real_axes import RealAxes
    from tierkv.tier import ColdTier
    from tierkv.transfer import Into

log = get_logger(__name__)


@dataclass
class _LoadResult:
    req_id: str
    failed_block_ids: set[int]
    blocks: int
    seconds: float
    nbytes: int
    """Bytes restored into the paged buffer."""
    window_blocks: int = 0
    window_bytes: int = 0
    """... of which into sliding-window groups."""


def block_parts(
    plan: GroupPlan, kv_caches: dict[str, torch.Tensor], num_blocks: int
) -> list[list[tuple[torch.Tensor, int]]]:
    """For each part of `plan`, per layer, a KV tensor and which of its dimensions is the block id.

    The CPU backend puts the block first ([blocks, heads, tokens, K|V]); layouts that put it
    elsewhere (e.g. K/V first) work too, their blocks are just strided.
    """
    parts: list[list[tuple[torch.Tensor, int]]] = [[] for _ in plan.parts]
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
                parts[part].append((state, 0))
        else:
            codec_dtype(cache.dtype, f"the KV cache of layer {name}")
            parts[0].append((cache, shape.index(num_blocks)))
    return parts


class TierWorker:
    """Worker-side data movement of the TierKV connector."""

    def __init__(
        self,
        tier: ColdTier,
        plans: Sequence[GroupPlan],
        *,
        tp_rank: int,
        staging_bytes: int,
        device_decode: bool | None = None,
        num_groups: int | None = None,
    ) -> None:
        """`device_decode`: decode loads on the KV cache's device (None: on CUDA for lossy
        codecs where measured faster at start, on the host otherwise); `num_groups`: vLLM's
        KV-cache groups, those tierkv does not plan included (None: as many as `plans`)."""
        self.tier = tier
        self.plans = {plan.group_id: plan for plan in plans}
        self.blockwise_failures = blockwise_load_failures(
            plans, len(plans) if num_groups is None else num_groups
        )
        self.tp_rank = tp_rank
        self.staging_bytes = staging_bytes
        self.device_decode = device_decode
        self.stats = TierKVStats()
        self._movers: dict[int, BlockMover] = {}
        """Empty while the KV caches are unregistered (vLLM's sleep mode)."""
        self._kv_caches: tuple[dict[str, torch.Tensor], int] | None = None
        self._rings: tuple[StagingRing, StagingRing] | None = None
        self._kv_splits: dict[int, tuple[int, int] | None] = {}
        self._token_axes: dict[int, int | None] = {}
        self._real: dict[int, RealAxes] = {}
        """Groups whose lossy payloads hold blocks in their real axes (tierkv.real_axes)."""
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tierkv-load")
        self._handoff = ThreadPoolExecutor(1, thread_name_prefix="tierkv-store")
        self._loading: dict[str, Future[_LoadResult]] = {}
        self._invalid_block_ids: set[int] = set()
        self._loads_started_for: TierKVMetadata | None = None

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        real: dict[int, RealAxes] | None = None,
    ) -> None:
        """Take views of the paged buffers. `real`: per group id, how the engine's attention
        really lays out its blocks when not as their shape says (vLLM CPU's): a lossy codec is
        handed such a group's blocks in their real axes."""
        self._real = dict(real or {})
        self.use_codec(self.tier.codec.name, self.tier.codec.group_size)
        devices = {cache.device for cache in kv_caches.values() if isinstance(cache, torch.Tensor)}
        pin = any(device.type == "cuda" for device in devices)
        self._rings = (
            StagingRing(self.staging_bytes, pin=pin),
            StagingRing(self.staging_bytes, pin=pin),
        )
        self._kv_caches = (kv_caches, num_blocks)
        self._take_views()
        if self.device_decode is None:
            self.device_decode = pin and self.tier.codec.name != "none" and self._measure_decode()

    def _measure_decode(self) -> bool:
        """Whether to decode on the device: measured at start on the first group's blocks
        (tierkv.movers.device_decode_pays), said in a log line."""
        from tierkv.quant.codec import encode_block

        group_id, mover = next(iter(self._movers.items()))
        split = self._kv_splits.get(group_id)
        dtype = mover.codec_dtypes[0]

        def encode(block: np.ndarray) -> bytes:
            return encode_block(self.tier.codec, block, dtype, kv_split=split)

        pays, why = device_decode_pays(mover, encode)
        log.info("restores decode on the %s: %s", "device" if pays else "host", why)
        return pays

    def _take_views(self) -> None:
        """One BlockMover per group over views of the registered paged buffers."""
        assert self._kv_caches is not None and self._rings is not None
        kv_caches, num_blocks = self._kv_caches
        store_ring, load_ring = self._rings
        parts = {
            group_id: block_parts(plan, kv_caches, num_blocks)
            for group_id, plan in self.plans.items()
        }
        self._movers = {
            group_id: BlockMover(found, store_ring, load_ring, self._real.get(group_id))
            for group_id, found in parts.items()
        }
        self._kv_splits = {
            group_id: REAL_KV_SPLIT
            if group_id in self._real
            else kv_split(self.plans[group_id], found[0])
            for group_id, found in parts.items()
        }
        self._token_axes = {
            group_id: REAL_TOKEN_AXIS
            if group_id in self._real
            else token_axis(self.plans[group_id], found[0])
            for group_id, found in parts.items()
        }

    def use_codec(self, name: str, group_size: int) -> None:
        """Store with codec `name` from now on, in groups of `group_size` values, or of the
        head size where `group_size` does not divide it (the sink codecs take whole vectors of
        a token's values, in a block in its real axes one head's: SmolLM2's 64 with the default
        128)."""
        from tierkv.quant import get_codec  # Numba: only on the worker
        from tierkv.quant.turbo import check_group_size

        heads = {plan.kv_widths[0] for plan in self.plans.values() if plan.kv_widths[0]}
        head = min(heads, default=0)
        if name != "none" and head and any(size % group_size for size in heads):
            try:
                check_group_size(name, head)
            except ValueError:
                pass
            else:
                log.info("codec %s: groups of %d values, the head size", name, head)
                group_size = head
        if (name, group_size) != (self.tier.codec.name, self.tier.codec.group_size):
            self.tier.codec = get_codec(name, group_size)

    def unregister_kv_caches(self) -> None:
        """Before vLLM's sleep mode unmaps the paged buffers: wait until no load writes into
        them and no store's copy reads them any more, then drop the views. Idempotent."""
        futures.wait(list(self._loading.values()))
        self._handoff.submit(lambda: None).result()  # handoffs wait for their device copies
        self._movers = {}

    def restore_kv_caches(self) -> None:
        """After wake-up: take the views again (the buffers are mapped back at the same
        addresses, their contents gone). Idempotent."""
        if self._kv_caches is not None and not self._movers:
            self._take_views()

    def largest_block_bytes(self) -> int:
        """Bytes of the largest array a block part is stored as (all its layers, stacked)."""
        return max(
            (
                mover.part_bytes(part)
                for mover in self._movers.values()
                for part in range(len(mover.parts))
            ),
            default=0,
        )

    # ---- stores ----------------------------------------------------------------------------

    def store_blocks(self, meta: TierKVMetadata) -> None:
        """Copy the picked blocks to host staging and hand them to the tier (returns at once)."""
        by_group: dict[int, list[StoreJob]] = defaultdict(list)
        for job in meta.stores:
            by_group[job.group_id].append(job)
        if by_group and not self._movers:
            log.warning(
                "%d blocks not stored: the KV caches are unregistered (sleep mode)",
                len(meta.stores),
            )
            self.stats.add("staging_dropped_blocks", len(meta.stores))
            return
        for group_id, jobs in by_group.items():
            mover = self._movers[group_id]
            fit = mover.fitting(len(jobs), mover.store_ring)
            staged = mover.store([job.block_id for job in jobs[:fit]]) if fit else None
            if staged is None:
                fit = 0
            if fit < len(jobs):
                self.stats.add("staging_dropped_blocks", len(jobs) - fit)
            if staged is None:
                continue
            plan = self.plans[group_id]
            self.stats.add("stored_blocks", fit)
            self.stats.add("stored_bytes", fit * mover.block_bytes)
            if plan.window:
                self.stats.add("stored_window_blocks", fit)
                self.stats.add("stored_window_bytes", fit * mover.block_bytes)
            if staged.done():
                self._hand_over(plan, mover, jobs[:fit], staged)
            else:  # encoding starts once the device-to-host copy has completed
                self._handoff.submit(self._hand_over, plan, mover, jobs[:fit], staged)

    def _hand_over(
        self, plan: GroupPlan, mover: BlockMover, jobs: Sequence[StoreJob], staged: Staged
    ) -> None:
        namespace = plan.namespaces[self.tp_rank]
        split = self._kv_splits.get(plan.group_id)
        axis = self._token_axes.get(plan.group_id)
        real = self._real.get(plan.group_id) if self.tier.codec.name != "none" else None

        def send(
            index: int, part: int, array: np.ndarray, dtype: str, on_done: Callable[[], None]
        ) -> None:
            job = jobs[index]
            sinks = None if axis is None else (axis, SINK_TOKENS if job.first else 0)
            self.tier.store(
                namespace,
                job.key,
                part,
                array,
                dtype,
                plan.vault,
                on_done=on_done,
                kv_split=split,
                sink_tokens=sinks,
            )

        if real is None:
            hand_over(staged, mover.codec_dtypes, send)
            return
        staged.wait()
        # One more copy (CPU engines only, as fast as the gather into staging), so the staging
        # goes back at once.
        blocks = real.to_real_axes(staged.arrays()[0])
        staged.release()
        for index in range(len(blocks)):
            send(index, 0, blocks[index], mover.codec_dtypes[0], _nothing)

    # ---- loads -----------------------------------------------------------------------------

    def start_loads(self, meta: TierKVMetadata) -> None:
        """Start the loads of a step's metadata, once: a second call with the same metadata
        (vLLM's start_load_kv after handle_preemptions) does nothing. The metadata is kept, so
        no later step's metadata can be a new object at its address."""
        if meta is self._loads_started_for:
            return
        self._loads_started_for = meta
        for job in meta.loads:
            if job.sync:
                self.stats.add("sync_loads")
                with _collections_paused():
                    self._account(self._load(job))
            else:
                self._loading[job.req_id] = self._loader.submit(self._load, job)

    def _load(self, job: LoadJob) -> _LoadResult:
        started = time.perf_counter()
        result = _LoadResult(job.req_id, set(), sum(len(load.keys) for load in job.groups), 0, 0)
        for load in job.groups:
            try:
                failed, restored = self._load_group(load)
            except Exception:
                log.exception("loading request %s failed; recomputing it", job.req_id)
                failed, restored = set(range(len(load.keys))), 0
            result.failed_block_ids.update(load.block_ids[index] for index in failed)
            result.nbytes += restored
            if self.plans[load.group_id].window:
                result.window_blocks += len(load.keys) - len(failed)
                result.window_bytes += restored
        result.seconds = time.perf_counter() - started
        return result

    def _load_group(self, load: GroupLoad) -> tuple[set[int], int]:
        """Restore one group's blocks in batches of up to half the staging; the indices (into
        load.keys) that failed, and the bytes restored. Returns once every copy has completed."""
        mover = self._movers.get(load.group_id)
        if mover is None:
            raise RuntimeError("the KV caches are unregistered (vLLM sleep mode)")
        plan = self.plans[load.group_id]
        namespace = plan.namespaces[self.tp_rank]

        def fetch(start: int, stop: int, consume: Consume, into: Into | None) -> set[int]:
            parts = {plan.vault: plan.parts}
            return self.tier.load_blocks(namespace, load.keys[start:stop], parts, consume, into)

        failed = mover.load(
            load.block_ids,
            fetch,
            batch_blocks=max(1, self.staging_bytes // 2 // mover.block_bytes),
            on_device=bool(self.device_decode),
        )
        return failed, (len(load.block_ids) - len(failed)) * mover.block_bytes

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

        Failed blocks are reported individually where vLLM can take them so (one full-attention
        group: `blockwise_load_failures`), else the whole request is reported failed.
        """
        self.stats.add("loads")
        self.stats.add("load_seconds", result.seconds)
        self.stats.add("loaded_blocks", result.blocks - len(result.failed_block_ids))
        self.stats.add("loaded_bytes", result.nbytes)
        self.stats.add("loaded_window_blocks", result.window_blocks)
        self.stats.add("loaded_window_bytes", result.window_bytes)
        self.stats.add("load_failed_blocks", len(result.failed_block_ids))
        if not result.failed_block_ids:
            return True
        log.warning(
            "%d of %d blocks of request %s were not restored (vault unreachable, "
            "blocks evicted or corrupt); vLLM recomputes them",
            len(result.failed_block_ids),
            result.blocks,
            result.req_id,
        )
        if self.blockwise_failures:
            self._invalid_block_ids |= result.failed_block_ids
            return True
        return False

    def take_invalid_block_ids(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        self._handoff.shutdown(wait=True)


@contextlib.contextmanager
def _collections_paused() -> Iterator[None]:
    """No cyclic garbage collection while a load runs before the step's forward (on the engine
    thread, nothing else running). A load keeps a few Python objects per block alive until it
    returns, enough to trigger a dozen young-generation passes, which inside vLLM (whose young
    generations hold the step's own objects) cost 1-8 ms of a 20-30 ms load. Those objects are
    acyclic and freed by reference counting when the load returns, so this skips the passes
    rather than postponing them. A collector someone else turned off stays off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


REAL_KV_SPLIT = (2, 1)
"""kv_split of a block in its real axes, [layers, heads, K|V, tokens, head_size]."""
REAL_TOKEN_AXIS = 3
"""token_axis of a block in its real axes."""


def _nothing() -> None:
    """on_done of a block the tier may keep: a copy, not staging."""


def kv_split(plan: GroupPlan, layers: Sequence[tuple[torch.Tensor, int]]) -> tuple[int, int] | None:
    """Where keys end and values begin in a stored attention block (every layer's block,
    stacked): vLLM's [..., head_size | head_size_v] content axis, else a K/V axis of 2 (K/V-first
    layouts); None when neither is found (a K/V pair codec then stores nothing)."""
    if not layers or plan.state_layout:
        return None
    tensor, block_dim = layers[0]
    shape = [size for dim, size in enumerate(tensor.shape) if dim != block_dim]
    keys, values = plan.kv_widths
    if keys and shape[-1] == keys + values:
        return -1, keys
    if 2 in shape:
        return 1 + shape.index(2), 1  # 1 + : the stacked block's leading layer axis
    return None


def token_axis(plan: GroupPlan, layers: Sequence[tuple[torch.Tensor, int]]) -> int | None:
    """The token axis of a stored attention block (every layer's block, stacked): where the
    layer's block holds plan.block_size (the CPU backend's [heads, tokens, K|V]: its second to
    last axis when two have that size); None for state groups or when no axis has it."""
    if not layers or plan.state_layout:
        return None
    tensor, block_dim = layers[0]
    shape = [size for dim, size in enumerate(tensor.shape) if dim != block_dim]
    if len(shape) >= 2 and shape[-2] == plan.block_size:
        return len(shape) - 1  # 1 + : the stacked block's leading layer axis
    if plan.block_size in shape[:-1]:
        return 1 + shape.index(plan.block_size)
    return None


def _state_views(page: torch.Tensor, layout: Sequence[tuple[tuple[int, ...], str]]):
    """Split a Mamba layer's raw per-block pages into typed state tensors (vLLM packs a layer's
    states back to back in each page, in the order of its MambaSpec)."""
    pages = page.view(page.shape[0], -1)
    offset = 0
    for shape, dtype_name in layout:
        dtype = getattr(torch, dtype_name)
        codec_dtype(dtype, f"a Mamba state of shape {shape}")
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        yield pages[:, offset : offset + nbytes].view(dtype)
        offset += nbytes
