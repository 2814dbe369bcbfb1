"""Prometheus metrics of one vault, served as /metrics on `[vault] metrics_port` (off by default).

What the store holds (entries, bytes, cap, hits, misses, evictions, per tier) is read from its
stats when scraped, and so are the gRPC port's open connections (from gRPC's channelz, where
this gRPC offers it); what the ports do (Put / Promote bytes and seconds, rejected blocks by
reason, open and refused bulk connections, gRPC calls refused by a concurrency limit, failed
authentications) is counted as it happens by the servicer and the bulk path through
`VaultMetrics`' methods, which an auth or limits layer calls too (`refused(reason)`,
`refused_call(reason)`, `auth_failed(path)`). Each vault has a registry of its own, so several can
run in one process (tests, the embedded bench vault).
"""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tierkv.vault.auth import is_loopback

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from tierkv.config import SecurityConfig
    from tierkv.vault.store import StoreStats

PATHS = ("grpc", "bulk")
"""How a call reached the vault: the gRPC port or the bulk data port."""
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(10, 33, 2))  # 1 KiB .. 4 GiB

_REASONS = {
    "exceeds the vault cap": "too_large",
    "checksum mismatch": "checksum",
    "malformed": "malformed",
    "zero-length": "empty",
    "limits.max_key_bytes": "key_too_long",
    "limits.max_namespace_bytes": "namespace_too_long",
}
"""A phrase of each rejection reason the store, the limits or the servicer give -> its label."""


def metrics_host(listen_host: str, *, insecure: bool, mutual_tls: bool) -> str:
    """Where /metrics listens for a vault on `listen_host`: that host when it is loopback, when
    the vault was started --insecure, or when scrapers must present a client certificate (mutual
    TLS); else this machine's loopback only, since /metrics checks no token and no listener
    beyond loopback goes unauthenticated without --insecure."""
    if insecure or mutual_tls or is_loopback(listen_host):
        return listen_host
    return "::1" if ":" in listen_host else "127.0.0.1"


def rejection_reason(reason: str) -> str:
    """The label of a rejection reason the store, the limits or the servicer gave: too_large,
    checksum, malformed, empty, key_too_long, namespace_too_long, or other."""
    return next((label for phrase, label in _REASONS.items() if phrase in reason), "other")


class _StoreCollector(Collector):
    """Reads the store's counters at scrape time, one sample per tier (ram, and disk if any)."""

    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        disk = stats.disk
        tiers: dict[str, tuple[float, ...]] = {
            # entries, bytes, cap, hits, evictions
            "ram": (
                stats.entries,
                stats.bytes_used,
                stats.max_bytes,
                stats.ram_hits,
                stats.evictions,
            ),
        }
        if disk is not None:
            tiers["disk"] = (
                disk.entries,
                disk.bytes_used,
                disk.max_bytes,
                stats.disk_hits,
                disk.evictions,
            )
        families: list[GaugeMetricFamily | CounterMetricFamily] = [
            GaugeMetricFamily("tierkv_vault_entries", "Blocks held", labels=["tier"]),
            GaugeMetricFamily("tierkv_vault_bytes", "Payload bytes held", labels=["tier"]),
            GaugeMetricFamily("tierkv_vault_cap_bytes", "Byte cap; 0 = unlimited", labels=["tier"]),
            CounterMetricFamily("tierkv_vault_hits", "Block parts found", labels=["tier"]),
            CounterMetricFamily("tierkv_vault_evictions", "Blocks evicted", labels=["tier"]),
        ]
        for tier, values in tiers.items():
            for family, value in zip(families, values, strict=True):
                family.add_metric([tier], value)
        yield from families
        yield CounterMetricFamily("tierkv_vault_misses", "Block parts asked for, not held",
                                  value=stats.misses)  # fmt: skip
        if disk is not None:
            yield CounterMetricFamily("tierkv_vault_disk_kept",
                                      "Read blocks copied forward when their segment was dropped",
                                      value=disk.kept)  # fmt: skip
            yield CounterMetricFamily("tierkv_vault_disk_corrupt",
                                      "Disk blocks that failed their checksum when read",
                                      value=disk.corrupt)  # fmt: skip


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


class _GrpcCollector(Collector):
    """The gRPC port's open connections at scrape time (nothing when channelz cannot tell)."""

    def __init__(self) -> None:
        self.server_id: int | None = None

    def collect(self) -> Iterator[Metric]:
        count = None if self.server_id is None else grpc_connections(self.server_id)
        if count is not None:
            yield GaugeMetricFamily(
                "tierkv_vault_grpc_open_connections", "Open connections of the gRPC port", count
            )


class VaultMetrics:
    """The counters of one vault and, once `serve`d, the HTTP server that exposes them."""

    def __init__(self, store_stats: Callable[[], StoreStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(store_stats))
        self._grpc = _GrpcCollector()
        self.registry.register(self._grpc)
        registry = self.registry
        self._rejected = Counter(
            "tierkv_vault_rejected_blocks",
            "Blocks refused by Put, by reason",
            ["reason"],
            registry=registry,
        )
        self._bytes = Counter(
            "tierkv_vault_transfer_bytes",
            "Payload bytes stored by Put / sent by Promote",
            ["method", "path"],
            registry=registry,
        )
        self._seconds = Histogram(
            "tierkv_vault_call_seconds",
            "Duration of Put and Promote calls (a bulk frame, or a whole gRPC stream)",
            ["method", "path"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self._call_bytes = Histogram(
            "tierkv_vault_call_bytes",
            "Payload bytes of one Put or Promote call",
            ["method", "path"],
            buckets=BYTES_BUCKETS,
            registry=registry,
        )
        self._connections = Gauge(
            "tierkv_vault_open_connections",
            "Open connections of the bulk data path",
            registry=registry,
        )
        self._refused = Counter(
            "tierkv_vault_refused_connections",
            "Connections refused, by reason",
            ["reason"],
            registry=registry,
        )
        self._refused_calls = Counter(
            "tierkv_vault_refused_calls",
            "gRPC calls refused by a concurrency limit, by reason",
            ["reason"],
            registry=registry,
        )
        self._auth_failures = Counter(
            "tierkv_vault_auth_failures",
            "Calls or connections that failed authentication, by path",
            ["path"],
            registry=registry,
        )
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def rejected(self, reason: str) -> None:
        """A block refused with `reason` (the store's or servicer's text)."""
        self._rejected.labels(rejection_reason(reason)).inc()

    def call(self, method: str, path: str, nbytes: int, seconds: float) -> None:
        """A Put or Promote call on `path` moved `nbytes` payload bytes in `seconds`."""
        self._bytes.labels(method, path).inc(nbytes)
        self._seconds.labels(method, path).observe(seconds)
        self._call_bytes.labels(method, path).observe(nbytes)

    def connection_opened(self) -> None:
        self._connections.inc()

    def connection_closed(self) -> None:
        self._connections.dec()

    def refused(self, reason: str) -> None:
        """A connection refused (e.g. "too_many", or a limit of the auth layer)."""
        self._refused.labels(reason).inc()

    def refused_call(self, reason: str) -> None:
        """A gRPC call refused RESOURCE_EXHAUSTED: "concurrency_limit" (limits.max_concurrent_rpcs)
        or "stream_limit" (Put / Promote streams at once)."""
        self._refused_calls.labels(reason).inc()

    def watch_grpc_server(self, server_id: int | None) -> None:
        """Report the open connections of the gRPC server of channelz id `server_id` (None:
        unknown, not reported)."""
        self._grpc.server_id = server_id

    def auth_failed(self, path: str) -> None:
        """A call or connection on `path` ("grpc" or "bulk") that failed authentication."""
        self._auth_failures.labels(path).inc()

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
