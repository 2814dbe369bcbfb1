"""Prometheus metrics of one vault, served as /metrics on `[vault] metrics_port` (off by default).

Names follow Prometheus conventions (docs/metrics.md lists each one, its type, labels and meaning,
and the names they replace): units in names (`_bytes`, `_seconds`), counters end `_total`, no
`_created` series, and every labelled counter has a zero series for each known label value from
the start, so a `rate()` or `increase()` alert has a series before the first event.

What the store holds (blocks, payload bytes, bookkeeping bytes, cap, hits, misses, evictions, per
tier; the disk tier's segments, filesystem room and start-up recovery) is read from it when
scraped, and so are the gRPC port's open connections (from gRPC's channelz, where this gRPC offers
it); what the ports do (Put / Promote bytes and seconds, rejected blocks by reason, open and refused
bulk connections, gRPC calls refused by a concurrency limit, failed authentications) is counted as
it happens by the servicer and the bulk path through `VaultMetrics`' methods, which an auth or
limits layer calls too (`refused(reason)`, `refused_call(reason)`, `auth_failed(transport)`). Each
vault has a registry of its own, so several can run in one process (tests, the embedded bench
vault). /metrics checks no token: `default_metrics_host` keeps it on loopback unless the vault is
open anyway or scrapers must present a client certificate.
"""

from __future__ import annotations

import importlib
import json
import shutil
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tierkv import __version__
from tierkv.vault.auth import is_loopback

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from tierkv.config import SecurityConfig
    from tierkv.vault.store import VaultStore

TRANSPORTS = ("grpc", "bulk")
"""How a call or connection reached the vault: the gRPC port or the bulk data port."""
METHODS = ("put", "promote")
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(10, 33, 2))  # 1 KiB .. 4 GiB

_REASONS = {
    "exceeds the vault cap": "too_large",
    "never fits the disk tier": "too_large",
    "checksum mismatch": "checksum",
    "malformed": "malformed",
    "zero-length": "empty",
    "limits.max_key_bytes": "key_too_long",
    "limits.max_namespace_bytes": "namespace_too_long",
    "disk tier did not write": "disk_write",
}
"""A phrase of each rejection reason the store, the limits or the servicer give -> its label."""
REJECTION_REASONS = (*dict.fromkeys(_REASONS.values()), "other")
REFUSED_CONNECTION_REASONS = ("connection_limit", "tenant_connection_limit")
"""Why the bulk port refuses a connection (bulk.py); a new reason has a series once used."""
REFUSED_CALL_REASONS = (
    "concurrency_limit",
    "tenant_concurrency_limit",
    "stream_limit",
    "tenant_stream_limit",
)


def default_metrics_host(listen_host: str, *, insecure: bool, mutual_tls: bool) -> str:
    """Where /metrics listens, unless told (`[vault] metrics_host`), for a vault on
    `listen_host`: that host when it is loopback, when the vault was started --insecure, or when
    scrapers must present a client certificate (mutual TLS); else this machine's loopback only,
    since /metrics checks no token and no listener beyond loopback goes unauthenticated without
    --insecure."""
    if insecure or mutual_tls or is_loopback(listen_host):
        return listen_host
    return "::1" if ":" in listen_host else "127.0.0.1"


def rejection_reason(reason: str) -> str:
    """The label of a rejection reason the store, the limits or the servicer gave: one of
    REJECTION_REASONS (other when no phrase matches)."""
    return next((label for phrase, label in _REASONS.items() if phrase in reason), "other")


class _StoreCollector(Collector):
    """Reads the store when scraped: one sample per tier (ram, and disk if any) of what it holds,
    and the disk tier's own figures."""

    def __init__(self, store: VaultStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        stats = self._store.stats()
        disk = stats.disk
        # blocks, payload bytes, bookkeeping bytes, cap, hits, evictions
        tiers: dict[str, tuple[float, ...]] = {
            "ram": (
                stats.entries,
                stats.payload_bytes,
                stats.bytes_used - stats.payload_bytes,
                stats.max_bytes,
                stats.ram_hits,
                stats.evictions,
            ),
        }
        if disk is not None:
            tiers["disk"] = (
                disk.entries,
                disk.live_bytes,
                disk.bytes_used - disk.live_bytes,
                disk.max_bytes,
                stats.disk_hits,
                disk.evictions,
            )
        families: list[GaugeMetricFamily | CounterMetricFamily] = [
            GaugeMetricFamily("tierkv_vault_blocks", "Block parts held", labels=["tier"]),
            GaugeMetricFamily(
                "tierkv_vault_payload_bytes", "Payload bytes of the blocks held", labels=["tier"]
            ),
            GaugeMetricFamily(
                "tierkv_vault_bookkeeping_bytes",
                "Bytes held besides payloads, counted against the cap: keys, namespaces and index "
                "entries (ram); record headers and not yet reclaimed records (disk)",
                labels=["tier"],
            ),
            GaugeMetricFamily("tierkv_vault_cap_bytes", "Byte cap; 0 = unlimited", labels=["tier"]),
            CounterMetricFamily("tierkv_vault_hits", "Block parts found", labels=["tier"]),
            CounterMetricFamily(
                "tierkv_vault_evictions",
                "Blocks pushed out by the cap (ram: moved to the disk tier when there is one)",
                labels=["tier"],
            ),
        ]
        for tier, values in tiers.items():
            for family, value in zip(families, values, strict=True):
                family.add_metric([tier], value)
        yield from families
        yield CounterMetricFamily(
            "tierkv_vault_misses", "Block parts asked for, held by no tier", value=stats.misses
        )
        disk_tier = self._store.disk
        if disk is None or disk_tier is None:
            return
        yield GaugeMetricFamily("tierkv_vault_disk_segments", "Segment files", disk.segments)
        yield GaugeMetricFamily(
            "tierkv_vault_disk_queued_bytes",
            "Payload bytes waiting to be written",
            disk.queued_bytes,
        )
        filesystem = shutil.disk_usage(disk_tier.directory)
        yield GaugeMetricFamily(
            "tierkv_vault_disk_filesystem_size_bytes",
            "Size of the filesystem holding the disk tier",
            filesystem.total,
        )
        yield GaugeMetricFamily(
            "tierkv_vault_disk_filesystem_free_bytes",
            "Free bytes of the filesystem holding the disk tier",
            filesystem.free,
        )
        yield CounterMetricFamily(
            "tierkv_vault_disk_kept_blocks",
            "Blocks copied forward when their segment was dropped: read since written (second "
            "chances), or of a tenant within its fair share of the disk",
            value=disk.kept,
        )
        yield CounterMetricFamily(
            "tierkv_vault_disk_corrupt_blocks",
            "Disk blocks that failed their checksum when read (dropped, served as misses)",
            value=disk.corrupt,
        )
        found = disk_tier.recovery
        yield GaugeMetricFamily(
            "tierkv_vault_disk_recovered_blocks", "Blocks recovered at start", found.blocks
        )
        yield GaugeMetricFamily(
            "tierkv_vault_disk_recovery_damaged_ranges",
            "Truncated tails or damaged ranges skipped when recovering at start",
            len(found.damaged),
        )
        yield GaugeMetricFamily(
            "tierkv_vault_disk_recovery_seconds", "Seconds recovery took at start", found.seconds
        )


def _channelz(query: str, *args: int) -> dict[str, Any]:
    """One page of a channelz query of this process's gRPC (grpcio's internal `cygrpc`: any
    failure, e.g. a grpcio without it, raises)."""
    cygrpc = importlib.import_module("grpc._cython.cygrpc")
    page = json.loads(getattr(cygrpc, query)(*args))
    if not isinstance(page, dict):
        raise ValueError(f"channelz {query}: not an object")
    return page


def grpc_server_ids() -> set[int]:
    """The channelz ids of the gRPC servers of this process (empty when channelz cannot tell)."""
    ids: set[int] = set()
    try:
        while True:
            page = _channelz("channelz_get_servers", max(ids, default=-1) + 1)
            found = {int(server["ref"]["serverId"]) for server in page.get("server", ())}
            if not found - ids:
                return ids
            ids |= found
            if page.get("end", True):
                return ids
    except Exception:  # no channelz in this grpcio, or a format it changed
        return set()


def grpc_connections(server_id: int) -> int | None:
    """Open connections of the gRPC server of channelz id `server_id`; None when unknown."""
    seen: set[int] = set()
    try:
        while True:
            page = _channelz("channelz_get_server_sockets", server_id, max(seen, default=-1) + 1, 0)
            found = {int(socket["socketId"]) for socket in page.get("socketRef", ())}
            if not found - seen:
                return len(seen)
            seen |= found
            if page.get("end", True):
                return len(seen)
    except Exception:  # the server is gone, or channelz changed
        return None


class _ConnectionsCollector(Collector):
    """Open connections per transport when scraped: the bulk port's as counted, the gRPC port's
    from channelz (no grpc sample when channelz cannot tell)."""

    def __init__(self) -> None:
        self.server_id: int | None = None
        self.bulk = 0
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "tierkv_vault_open_connections", "Open connections, by transport", labels=["transport"]
        )
        family.add_metric(["bulk"], self.bulk)
        count = None if self.server_id is None else grpc_connections(self.server_id)
        if count is not None:
            family.add_metric(["grpc"], count)
        yield family


def _counter(
    name: str, documentation: str, label: str, values: tuple[str, ...], registry: CollectorRegistry
) -> Counter:
    """A counter labelled `label`, with a zero series for each of `values` from the start."""
    counter = Counter(name, documentation, [label], registry=registry)
    for value in values:
        counter.labels(value)
    return counter


class VaultMetrics:
    """The counters of one vault and, once `serve`d, the HTTP server that exposes them."""

    def __init__(self, store: VaultStore, role: str) -> None:
        # No `_created` series (they double the series and help no query). prometheus_client
        # has only a process-wide switch, so it is thrown by a vault, not by importing this
        # module (an engine imports it through the client, and its metrics are vLLM's to set).
        disable_created_metrics()
        self.registry = registry = CollectorRegistry()
        registry.register(_StoreCollector(store))
        self._connections = _ConnectionsCollector()
        registry.register(self._connections)
        Info("tierkv_build", "The tierkv version of this vault", registry=registry).info(
            {"version": __version__}
        )
        Info("tierkv_vault", "The role this vault serves", registry=registry).info({"role": role})
        Gauge(
            "tierkv_vault_start_time_seconds",
            "When this vault started, in seconds since the Unix epoch",
            registry=registry,
        ).set(time.time())
        self._rejected = _counter(
            "tierkv_vault_rejected_blocks",
            "Blocks refused by Put, by reason",
            "reason",
            REJECTION_REASONS,
            registry,
        )
        labels = ["method", "transport"]
        self._bytes = Counter(
            "tierkv_vault_transfer_bytes",
            "Payload bytes stored by Put / sent by Promote",
            labels,
            registry=registry,
        )
        self._seconds = Histogram(
            "tierkv_vault_call_seconds",
            "Duration of Put and Promote calls (a bulk frame, or a whole gRPC stream)",
            labels,
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self._call_bytes = Histogram(
            "tierkv_vault_call_bytes",
            "Payload bytes of one Put or Promote call",
            labels,
            buckets=BYTES_BUCKETS,
            registry=registry,
        )
        for method in METHODS:
            for transport in TRANSPORTS:
                for metric in (self._bytes, self._seconds, self._call_bytes):
                    metric.labels(method, transport)
        self._refused = _counter(
            "tierkv_vault_refused_connections",
            "Bulk connections refused, by reason",
            "reason",
            REFUSED_CONNECTION_REASONS,
            registry,
        )
        self._refused_calls = _counter(
            "tierkv_vault_refused_calls",
            "gRPC calls refused RESOURCE_EXHAUSTED by a concurrency limit, by reason",
            "reason",
            REFUSED_CALL_REASONS,
            registry,
        )
        self._auth_failures = _counter(
            "tierkv_vault_auth_failures",
            "Calls or connections that failed authentication, by transport",
            "transport",
            TRANSPORTS,
            registry,
        )
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def rejected(self, reason: str) -> None:
        """A block refused with `reason` (the store's or servicer's text)."""
        self._rejected.labels(rejection_reason(reason)).inc()

    def call(self, method: str, transport: str, nbytes: int, seconds: float) -> None:
        """A Put or Promote call on `transport` moved `nbytes` payload bytes in `seconds`."""
        self._bytes.labels(method, transport).inc(nbytes)
        self._seconds.labels(method, transport).observe(seconds)
        self._call_bytes.labels(method, transport).observe(nbytes)

    def connection_opened(self) -> None:
        """A bulk connection was accepted."""
        with self._connections.lock:
            self._connections.bulk += 1

    def connection_closed(self) -> None:
        """A bulk connection ended."""
        with self._connections.lock:
            self._connections.bulk -= 1

    def refused(self, reason: str) -> None:
        """A bulk connection refused (e.g. "connection_limit", or a limit of the auth layer)."""
        self._refused.labels(reason).inc()

    def refused_call(self, reason: str) -> None:
        """A gRPC call refused RESOURCE_EXHAUSTED: "concurrency_limit" (limits.max_concurrent_rpcs),
        "tenant_concurrency_limit" (limits.max_concurrent_rpcs_per_tenant), "stream_limit"
        (Put / Promote streams at once) or "tenant_stream_limit" (a tenant's share of them)."""
        self._refused_calls.labels(reason).inc()

    def watch_grpc_server(self, server_id: int | None) -> None:
        """Report the open connections of the gRPC server of channelz id `server_id` (None:
        unknown, not reported)."""
        self._connections.server_id = server_id

    def auth_failed(self, transport: str) -> None:
        """A call or connection on `transport` ("grpc" or "bulk") that failed authentication."""
        self._auth_failures.labels(transport).inc()

    def serve(self, host: str, port: int, security: SecurityConfig) -> int:
        """Serve /metrics on `host`:`port` (0: any free port) in a thread; the bound port.

        With the vault's certificate (`security.tls_cert`) /metrics is HTTPS, and with
        `security.client_ca` a scraper must present a certificate signed by it, as on the
        vault's own ports. OSError when the address cannot be bound."""
        self._server, self._thread = start_http_server(
            port,
            addr=host,
            registry=self.registry,
            certfile=security.tls_cert,
            keyfile=security.tls_key,
            client_cafile=security.client_ca,
            client_auth_required=security.client_ca is not None,
        )
        return int(self._server.server_port)

    def stop(self) -> None:
        """Stop serving /metrics (if it was)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
