"""Scheduler side of the vLLM connector: lookups, what to store and load, step metadata.

It holds no tensors. Each engine step it decides:
- **loads**: for a new request, how many tokens beyond vLLM's own prefix cache the vaults hold
  (every group and every tensor-parallel rank present, so all ranks agree on one hit length),
  and after vLLM has allocated blocks for them, which vault keys go into which block ids. A hit
  needs the whole prefix of full-attention groups, only the blocks inside the window before the
  hit end of sliding-window groups (vLLM puts its null block in place of the earlier ones, as
  for its own prefix-cache hits) and the state at the hit end of Mamba groups;
- **stores**: which engine blocks to copy out: the cached blocks nearest the head of vLLM's
  free-block queue (the next ones its allocator will reuse), walked through the block pool vLLM
  hands every connector (`bind_gpu_block_pool`); with `store = "on_finish"` also a finished
  request's cached blocks at once. A free block carries only vLLM's (per-process seeded) block
  hash, so the scheduler learns hash -> tierkv key pairs from the requests it sees
  (`request.block_hashes` against tierkv's chained keys of the same tokens).

Why no reference counting is needed: a block that is in the free queue (or was just freed) when
step N's metadata is built is reallocated at the earliest by step N+1's schedule, and written by
step N+1's forward, while the worker copies it out at the start of step N (`handle_preemptions`),
so the copy always sees the bytes vLLM cached.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

from tierkv.connectors.vllm.groups import GroupPlan, blockwise_load_failures
from tierkv.connectors.vllm.stats import TierKVStats
from tierkv.keys import ROOT_KEY, chain_block_keys, namespace_fingerprint
from tierkv.logs import get_logger

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    from tierkv.tier import ColdTier

log = get_logger(__name__)

LOOKUP_WAIT_S = 0.05
"""How long a step waits for a vault lookup before vLLM is told to ask again next step."""
MAX_STATE_PROBES = 64
"""How many block boundaries to try, from the longest down, when looking for stored SSM state
or for a sliding window every group holds."""


@dataclass
class GroupLoad:
    """Load `keys` (consecutive blocks of one group) into `block_ids`, index for index."""

    group_id: int
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class LoadJob:
    """Everything one request restores from the vaults."""

    req_id: str
    groups: list[GroupLoad]
    sync: bool = False
    """Load before this step's forward (and report errors in it) instead of in the background."""


@dataclass
class StoreJob:
    """Copy block `block_id` of group `group_id` out and store it under `key`."""

    group_id: int
    block_id: int
    key: bytes
    first: bool = False
    """The block is its sequence's first (a sink codec keeps its first tokens lossless)."""


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    """What the workers do in one engine step."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)


@dataclass
class _Tracked:
    request: Request
    keys: list[bytes] = field(default_factory=list)
    mapped: int = 0


@dataclass
class _PendingLoad:
    num_computed_tokens: int
    keys: list[bytes]
    first_block: int
    num_blocks: int
    asked_blocks: int
    seconds: float
    sync: bool = False


class TierScheduler:
    """Scheduler-side bookkeeping of the TierKV connector."""

    def __init__(
        self,
        tier: ColdTier,
        plans: Sequence[GroupPlan],
        *,
        store_mode: str,
        eviction_watermark_blocks: int,
        num_engine_blocks: int,
        num_groups: int | None = None,
    ) -> None:
        """`num_groups`: vLLM's KV-cache groups, those tierkv does not plan included (None: as
        many as `plans`)."""
        self.tier = tier
        self.plans = list(plans)
        # A load runs before the forward only where its failures can be reported block by block.
        self._sync_allowed = blockwise_load_failures(
            plans, len(plans) if num_groups is None else num_groups
        )
        self.block_size = plans[0].block_size if plans else 0
        self.store_mode = store_mode
        self.watermark = eviction_watermark_blocks
        self.stats = TierKVStats()
        self._pool: BlockPool | None = None
        self._pending_loads: dict[str, _PendingLoad] = {}
        self._lookups: dict[str, tuple[int, Future[_PendingLoad]]] = {}
        self._lookup_thread = ThreadPoolExecutor(1, thread_name_prefix="tierkv-lookup")
        self._loads: list[LoadJob] = []
        self._stores: list[StoreJob] = []
        self._group_ids = {plan.group_id for plan in self.plans}
        self._tracked: dict[str, _Tracked] = {}
        self._live: set[str] = set()  # requests vLLM asked about and that have not finished
        # request -> (group, engine block, key) of each block it restores
        self._loaded_into: dict[str, list[tuple[int, int, bytes]]] = {}
        self._failed_loads: set[str] = set()  # requests whose restore failed: recompute them
        # vLLM block hash -> (tierkv key, whether it is its sequence's first block), and the
        # (group, key) pairs recently sent; both bounded.
        self._hash_keys: OrderedDict[bytes, tuple[bytes, bool]] = OrderedDict()
        self._stored: OrderedDict[tuple[int, bytes], None] = OrderedDict()
        self._hash_capacity = max(4 * num_engine_blocks * max(1, len(self.plans)), 4096)

    def bind_block_pool(self, pool: BlockPool) -> None:
        if pool.hash_block_size != self.block_size:
            log.warning(
                "vLLM hashes blocks of %d tokens but stores blocks of %d; "
                "evicted blocks are not stored",
                pool.hash_block_size,
                self.block_size,
            )
            return
        self._pool = pool

    # ---- loads -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens the vaults hold beyond `num_computed_tokens`, and whether to load them in the
        background; None while the vault lookup is still running.

        The lookup runs on a thread: when it takes longer than LOOKUP_WAIT_S (a slow or dead
        vault; the client gives up after its deadline) vLLM is told to ask again next step, so
        the engine keeps serving other requests meanwhile. Loads are asynchronous unless this
        request is the only one the engine has and the model has one KV-cache group: then
        nothing is held up, and a load on the engine thread skips vLLM polling for its
        completion (measured about 3x faster on 2 CPU cores). The answer is remembered until
        blocks are allocated, so repeated questions cost no round trip.
        """
        if not self.plans:
            return 0, False
        req_id = request.request_id
        self._live.add(req_id)
        self._track(request)
        if req_id in self._failed_loads:
            return 0, False
        pending = self._pending_loads.get(req_id)
        if pending is None or pending.num_computed_tokens != num_computed_tokens:
            lookup = self._lookups.get(req_id)
            if lookup is None or lookup[0] != num_computed_tokens:
                future = self._lookup_thread.submit(self._lookup, request, num_computed_tokens)
                lookup = self._lookups[req_id] = (num_computed_tokens, future)
            try:
                pending = lookup[1].result(timeout=LOOKUP_WAIT_S)
            except FutureTimeout:
                return None, False
            del self._lookups[req_id]
            self._pending_loads[req_id] = pending
            self.stats.observe_lookup(pending.num_blocks, pending.asked_blocks, pending.seconds)
        matched = pending.num_blocks * self.block_size
        pending.sync = self._sync_allowed and self._live == {req_id}
        return matched, matched > 0 and not pending.sync

    def _lookup(self, request: Request, num_computed_tokens: int) -> _PendingLoad:
        keys = request_keys(request, self.block_size) or []
        first = num_computed_tokens // self.block_size
        # vLLM must compute at least the last prompt token itself.
        last = min(len(keys), (request.num_tokens - 1) // self.block_size)
        if last <= first:
            return _PendingLoad(num_computed_tokens, keys, first, 0, 0, 0.0)
        started = time.perf_counter()
        hit = last
        for plan in self.plans:
            if plan.is_state or plan.window:
                continue
            for namespace in plan.namespaces:
                found = self.tier.lookup(namespace, keys[first:hit], {plan.vault: plan.parts})
                hit = first + found
                if hit == first:
                    break
        # Each rule gives the longest end <= its argument that its group can restore; every
        # group agrees once none lowers the end any more.
        partial = [plan for plan in self.plans if plan.is_state or plan.window]
        for _ in range(MAX_STATE_PROBES):
            agreed = hit
            for plan in partial:
                if agreed > first:
                    rule = self._state_hit if plan.is_state else self._window_hit
                    agreed = rule(plan, keys, first, agreed)
            if agreed == hit:
                break
            hit = agreed
        else:
            hit = first
        seconds = time.perf_counter() - started
        return _PendingLoad(num_computed_tokens, keys, first, hit - first, last - first, seconds)

    def _state_hit(self, plan: GroupPlan, keys: list[bytes], first: int, hit: int) -> int:
        """The longest boundary <= hit whose recurrent state every rank stored (else `first`)."""
        for end in range(hit, max(first, hit - MAX_STATE_PROBES), -1):
            if all(
                self.tier.lookup(namespace, [keys[end - 1]], {plan.vault: plan.parts}) == 1
                for namespace in plan.namespaces
            ):
                return end
        return first

    def _window_hit(self, plan: GroupPlan, keys: list[bytes], first: int, hit: int) -> int:
        """The longest end <= hit for which every rank stored the blocks inside the window
        (else `first`). A block missing at index m rules out every end past m: the next end
        tried is m itself, whose window stops just before it."""
        for _ in range(MAX_STATE_PROBES):
            if hit <= first:
                return first
            start = max(first, plan.window_start(hit))
            found = min(
                self.tier.lookup(namespace, keys[start:hit], {plan.vault: plan.parts})
                for namespace in plan.namespaces
            )
            if start + found == hit:
                return hit
            hit = start + found
        return first

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Turn the agreed hit into a load job now that vLLM has allocated its blocks."""
        pending = self._pending_loads.pop(request.request_id, None)
        if num_external_tokens == 0:
            return
        if pending is None or pending.num_blocks * self.block_size != num_external_tokens:
            raise RuntimeError(
                f"tierkv: vLLM allocated {num_external_tokens} external tokens for request "
                f"{request.request_id} that the vault lookup did not offer"
            )
        first = pending.first_block
        end = first + num_external_tokens // self.block_size
        loads = []
        for plan in self.plans:
            group_blocks = blocks.blocks[plan.group_id]
            if plan.is_state:
                indices = [end - 1]
            else:  # vLLM's null blocks (outside a window) are left as they are
                start = max(first, plan.window_start(end))
                indices = [index for index in range(start, end) if not group_blocks[index].is_null]
            loads.append(
                GroupLoad(
                    plan.group_id,
                    [pending.keys[index] for index in indices],
                    [group_blocks[index].block_id for index in indices],
                )
            )
        self._loads.append(LoadJob(request.request_id, loads, pending.sync))
        restored = [
            (load.group_id, block_id, key)
            for load in loads
            for block_id, key in zip(load.block_ids, load.keys, strict=True)
        ]
        self._loaded_into[request.request_id] = restored
        # What comes from the vaults is there already: not stored again when it is freed
        # (unless its load fails, see loads_reported).
        for group_id, _, key in restored:
            self._remember_stored((group_id, key))

    def loads_reported(self, invalid_block_ids: set[int], failed_req_ids: set[str]) -> None:
        """Note the requests whose restore failed (the workers' load errors of a step).

        vLLM asks again about a request whose background load failed, and the vaults would
        offer the same blocks, which would likely fail the same way: a corrupt block again and
        again, a vault that answers lookups but not promotes. Such a request is recomputed.
        """
        for req_id, restored in self._loaded_into.items():
            failed = [
                (group_id, key)
                for group_id, block_id, key in restored
                if req_id in failed_req_ids or block_id in invalid_block_ids
            ]
            if failed:
                self._failed_loads.add(req_id)
            for marker in failed:  # recomputed, so stored again when freed
                self._stored.pop(marker, None)

    # ---- stores ----------------------------------------------------------------------------

    def _track(self, request: Request) -> None:
        """Follow a request so its blocks' vLLM hashes can be mapped to tierkv keys."""
        if request.request_id not in self._tracked and tokens_determine_kv(request):
            self._tracked[request.request_id] = _Tracked(request)

    def _map_hashes(self) -> None:
        """Learn vLLM block hash -> tierkv key for every full block of the tracked requests.

        Both are content hashes of the same prefix, so the pair stays valid whatever happens to
        the engine block; a block found in the free queue is then stored under its tierkv key.
        """
        for tracked in self._tracked.values():
            request = tracked.request
            hashes = request.block_hashes
            if len(tracked.keys) < len(hashes):
                start = len(tracked.keys) * self.block_size
                parent = tracked.keys[-1] if tracked.keys else request_parent_key(request)
                tokens = request.all_token_ids[start : len(hashes) * self.block_size]
                tracked.keys.extend(chain_block_keys(list(tokens), self.block_size, parent))
            for index in range(tracked.mapped, min(len(hashes), len(tracked.keys))):
                self._hash_keys[hashes[index]] = (tracked.keys[index], index == 0)
                self._hash_keys.move_to_end(hashes[index])
            tracked.mapped = max(tracked.mapped, min(len(hashes), len(tracked.keys)))
        while len(self._hash_keys) > self._hash_capacity:
            self._hash_keys.popitem(last=False)

    def request_finished(self, request: Request, block_ids: Sequence[Sequence[int]]) -> None:
        """Stop following a finished request; store its blocks with `store = "on_finish"`, and
        also on eviction when fewer blocks are free than the watermark: then they may be reused
        by the very next schedule, before a walk of the free queue could see them."""
        self._pending_loads.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        pool = self._pool
        if pool is not None and (
            self.store_mode == "on_finish" or pool.get_num_free_blocks() < self.watermark
        ):
            self._map_hashes()
            for plan in self.plans:
                for block_id in block_ids[plan.group_id]:
                    self._store_if_known(pool.blocks[block_id])
        self._tracked.pop(request.request_id, None)
        self._live.discard(request.request_id)
        self._loaded_into.pop(request.request_id, None)
        self._failed_loads.discard(request.request_id)

    def _collect_evictions(self) -> None:
        """Queue stores for known blocks among the next `watermark` blocks vLLM will reuse."""
        if self._pool is None:
            return
        for seen, block in enumerate(self._pool.free_block_queue.iter_blocks_after(None)):
            if seen >= self.watermark:
                break
            self._store_if_known(block)

    def _store_if_known(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None or block.is_null:
            return
        group_id = get_group_id(block_hash)
        known = self._hash_keys.get(get_block_hash(block_hash))
        if known is None or group_id not in self._group_ids:
            return
        key, first = known
        if self._remember_stored((group_id, key)):
            self._stores.append(StoreJob(group_id, block.block_id, key, first))

    def _remember_stored(self, marker: tuple[int, bytes]) -> bool:
        """Note that (group, key) is in the vaults; False when it was known already."""
        if marker in self._stored:
            self._stored.move_to_end(marker)
            return False
        self._stored[marker] = None
        if len(self._stored) > self._hash_capacity:
            self._stored.popitem(last=False)
        return True

    # ---- per step --------------------------------------------------------------------------

    def build_connector_meta(self) -> TierKVMetadata:
        self._map_hashes()
        # Also with "on_finish": blocks freed before their request finished (Mamba states the
        # request moved past, preempted requests' blocks) are caught on their way out.
        self._collect_evictions()
        meta = TierKVMetadata(loads=self._loads, stores=self._stores)
        self._loads, self._stores = [], []
        return meta

    def shutdown(self) -> None:
        self._lookup_thread.shutdown(wait=True, cancel_futures=True)

    def forget_stored(self) -> None:
        """Forget which keys were sent, and drop the stores not yet handed to the workers (after
        the vaults or the engine cache were reset: vLLM resets it before sleep mode discards the
        paged buffers, whose blocks would then be stored as whatever they hold after wake-up)."""
        self._stored.clear()
        self._stores.clear()


def request_keys(request: Request, block_size: int) -> list[bytes] | None:
    """tierkv's chained keys of the request's full blocks; None when tokens alone do not
    determine its KV (multimodal inputs, prompt embeddings)."""
    if not tokens_determine_kv(request):
        return None
    return chain_block_keys(list(request.all_token_ids), block_size, request_parent_key(request))


def tokens_determine_kv(request: Request) -> bool:
    """False for multimodal inputs and prompt embeddings, whose KV the token ids do not pin."""
    return (
        not request.mm_features
        and request.prompt_token_ids is not None
        and getattr(request, "prompt_is_token_ids", None) is None
    )


def request_parent_key(request: Request) -> bytes:
    """The chain's root: distinct per cache salt and LoRA adapter, which change the KV."""
    lora = getattr(request, "lora_request", None)
    if request.cache_salt is None and lora is None:
        return ROOT_KEY
    return namespace_fingerprint(
        {"cache_salt": request.cache_salt, "lora": getattr(lora, "lora_name", None)}
    )
