"""Connector statistics in vLLM's `KVConnectorStats` form: hits, misses, bytes, latencies.

Both connector sides fill one; vLLM aggregates the workers' and the scheduler's objects each step
and logs `reduce()` with its other metrics, and `TierKVPromMetrics` adds each counter to vLLM's
Prometheus /metrics as `vllm:tierkv_<counter>_total` (at zero from the start, per engine), except
`cold_tier_off`, a state, which is the gauge `vllm:tierkv_cold_tier_off` (docs/metrics.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS = (
    "lookups",  # requests asked about
    "lookup_hits",  # ... of which the vaults held at least one block
    "lookup_hit_blocks",
    "lookup_miss_blocks",  # blocks asked about but not held
    "lookup_seconds",
    "loads",
    "sync_loads",  # ... of which ran before a forward (nothing else was running)
    "loaded_blocks",
    "loaded_bytes",
    "loaded_window_blocks",  # ... of which into sliding-window layers (only their window)
    "loaded_window_bytes",
    "load_failed_blocks",  # reported to vLLM as load errors and recomputed
    "load_seconds",
    "stored_blocks",
    "stored_bytes",
    "stored_window_blocks",  # ... of which of sliding-window layers
    "stored_window_bytes",
    "staging_dropped_blocks",  # not copied out: the step's staging budget was spent
    "store_dropped_blocks",  # copied out, then lost: encode budget, put queue or a dead vault
    "open_failed_blocks",  # sealed blocks that did not open (changed, moved, another key): misses
    "cold_tier_off",  # 1: the model has a KV-cache group kind tierkv does not store
)
GAUGES = ("cold_tier_off",)
"""Counters that are states: exported as gauges (set to 1 once any engine reported one)."""


@dataclass
class TierKVStats(KVConnectorStats):
    """Counters (cumulative on a connector side; `take_interval` gives what vLLM is sent)."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        self._reported: dict[str, float] = {}

    def add(self, name: str, amount: float = 1) -> None:
        self.data[name] += amount

    def observe_lookup(self, hit_blocks: int, asked_blocks: int, seconds: float) -> None:
        self.add("lookups")
        self.add("lookup_hits", int(hit_blocks > 0))
        self.add("lookup_hit_blocks", hit_blocks)
        self.add("lookup_miss_blocks", asked_blocks - hit_blocks)
        self.add("lookup_seconds", seconds)

    def reset(self) -> None:
        for name in COUNTERS:
            self.data[name] = 0

    def take_interval(self) -> TierKVStats | None:
        """What changed since the last call (None when nothing did)."""
        interval = TierKVStats(
            data={name: self.data[name] - self._reported.get(name, 0) for name in COUNTERS}
        )
        self._reported = dict(self.data)
        return None if interval.is_empty() else interval

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            name: self.data[name] for name in COUNTERS if not name.endswith("seconds")
        }
        out["avg_lookup_ms"] = 1000 * self.data["lookup_seconds"] / max(self.data["lookups"], 1)
        out["avg_load_ms"] = 1000 * self.data["load_seconds"] / max(self.data["loads"], 1)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)


class TierKVPromMetrics(KVConnectorPromMetrics):
    """Every counter of TierKVStats as a Prometheus counter of vLLM's, per engine (GAUGES as
    gauges)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Counter]] = {
            name: create_metric_per_engine(  # type: ignore[misc]
                self._counter_cls(
                    name=f"vllm:tierkv_{name}",
                    documentation=f"tierkv connector: {name.replace('_', ' ')}",
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for name in COUNTERS
            if name not in GAUGES
        }
        self._gauges: dict[str, dict[int, Gauge]] = {
            name: create_metric_per_engine(  # type: ignore[misc]
                self._gauge_cls(  # type: ignore[call-arg]
                    name=f"vllm:tierkv_{name}",
                    documentation=f"tierkv connector: {name.replace('_', ' ')} (1: yes)",
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                ),
                per_engine_labelvalues,
            )
            for name in GAUGES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, counters in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value > 0:
                counters[engine_idx].inc(value)
        for name, gauges in self._gauges.items():
            if transfer_stats_data.get(name, 0) > 0:
                gauges[engine_idx].set(1)
