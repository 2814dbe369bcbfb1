"""Valkey / Redis as a Backend: blocks stored directly in the server, no tierkv process needed.

A block part is the string key ``tierkv:<namespace hex>:{<block key hex>}:<part>`` holding the
8-byte little-endian checksum (checksum.block_checksum, as on the vault) followed by the payload.
The block key is the hash tag, so in a cluster all parts of a block share one slot (one node).
Reads are pipelined (one round trip per batch), bounded by the client deadline per read and by
the promote deadline in all; puts go through the shared PutQueue; the breaker is the shared one.
Lookup and Promote agree on what is present: Lookup counts a value only when it is long enough to
hold its checksum (STRLEN, no payload read), and a value Promote finds damaged it removes (unless
a put has replaced it meanwhile), so the next Lookup misses too.
Capacity is the server's: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru``.

`redis+cluster://host:port` (or `rediss+cluster://`) is a Redis Cluster: its slot map is read
from the node named (and refreshed when a node fails), each primary is one RedisBackend, and
calls fan out to the nodes in parallel through ShardedBackend, so a dead node costs its slots.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import key_slot
from redis.exceptions import RedisError
from redis.retry import Retry

from tierkv.addresses import format_address, redact
from tierkv.backends.base import Backend, BackendStats, BackendUnavailable
from tierkv.backends.sharded import ShardedBackend
from tierkv.checksum import block_checksum
from tierkv.config import ClientConfig, SecurityConfig
from tierkv.logs import get_logger
from tierkv.reliability import CircuitBreaker, PendingPut, PutPayload, PutQueue
from tierkv.transfer import Into

log = get_logger(__name__)

USERNAME_ENV = "TIERKV_REDIS_USERNAME"
PASSWORD_ENV = "TIERKV_REDIS_PASSWORD"
PROMOTE_BATCH = 256
"""GETs per pipelined round trip of a promote."""
_CHECKSUM_BYTES = 8
_FAILURES = (RedisError, OSError)


def redis_key(namespace: bytes, key: bytes, part: int) -> bytes:
    """The server key of one block part (the block key is the cluster hash tag)."""
    return b"tierkv:%s:{%s}:%d" % (namespace.hex().encode(), key.hex().encode(), part)


def connection_options(
    url: str, client_cfg: ClientConfig, security: SecurityConfig | None = None
) -> dict[str, Any]:
    """redis-py keyword arguments for `url`: db, credentials (config, else env, else URL) and,
    for rediss://, TLS verified against security.tls_ca (else the system's CAs), with
    security.tls_cert / tls_key as the client certificate when set."""
    parts = urlsplit(url)
    options: dict[str, Any] = {
        "socket_timeout": client_cfg.deadline_ms / 1000,
        "socket_connect_timeout": client_cfg.deadline_ms / 1000,
        "retry": Retry(NoBackoff(), 0),  # a failure is a miss at once; the breaker decides
        "username": client_cfg.redis_username or os.environ.get(USERNAME_ENV) or parts.username,
        "password": client_cfg.redis_password or os.environ.get(PASSWORD_ENV) or parts.password,
    }
    if parts.scheme.startswith("rediss"):
        security = security or SecurityConfig()
        options["ssl"] = True
        options["ssl_ca_certs"] = security.tls_ca
        options["ssl_certfile"] = security.tls_cert
        options["ssl_keyfile"] = security.tls_key
    if parts.path.strip("/"):
        options["db"] = int(parts.path.strip("/"))
    return options


class RedisBackend:
    """One Valkey / Redis server (or one cluster node); thread-safe."""

    def __init__(
        self,
        address: str,
        client: redis.Redis,
        *,
        deadline_s: float = 2.0,
        promote_deadline_s: float = 30.0,
        max_pending_bytes: int = 256 * 1024 * 1024,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 5.0,
    ) -> None:
        self.address = redact(address)
        self.deadline_s = deadline_s
        self.promote_deadline_s = promote_deadline_s
        self._client = client
        self._breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s, self._ping)
        self._queue = PutQueue(self.address, self._send, self._breaker, max_pending_bytes)
        self._lock = threading.Lock()
        self.checksum_failures = 0
        self.failed_calls = 0

    @classmethod
    def connect(
        cls, host: str, port: int, options: dict[str, Any], client_cfg: ClientConfig, label: str
    ) -> RedisBackend:
        """A backend for the server at host:port with `connection_options`."""
        client = redis.Redis(host=host, port=port, **options)
        return cls(
            label,
            client,
            deadline_s=client_cfg.deadline_ms / 1000,
            promote_deadline_s=client_cfg.promote_deadline_ms / 1000,
            max_pending_bytes=client_cfg.max_pending_bytes,
            breaker_failures=client_cfg.breaker_failures,
            breaker_cooldown_s=client_cfg.breaker_cooldown_s,
        )

    @property
    def breaker_state(self) -> str:
        return self._breaker.state

    def put(
        self,
        namespace: bytes,
        key: bytes,
        part: int,
        payload: PutPayload,
        release: Callable[[], None] | None = None,
    ) -> None:
        self._queue.put(namespace, key, part, payload, release)

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        if not keys or not self._breaker.allow():
            return 0
        wanted = sorted(set(parts))
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            for part in wanted:
                pipe.strlen(redis_key(namespace, key, part))
        try:
            lengths = pipe.execute(raise_on_error=False)
        except _FAILURES:
            self._record_failure()
            return 0
        self._breaker.record_success()
        for index in range(len(keys)):
            of_key = lengths[index * len(wanted) : (index + 1) * len(wanted)]
            # 0: absent; an error (another type, MOVED): a miss, as Promote has it
            if not all(isinstance(n, int) and n >= _CHECKSUM_BYTES for n in of_key):
                return index
        return len(keys)

    def promote(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts: Sequence[int],
        into: Into | None = None,
    ) -> dict[tuple[int, int], memoryview]:
        """See Backend.promote (`into` is not used: redis-py hands over its own bytes)."""
        found: dict[tuple[int, int], memoryview] = {}
        if not keys or not parts or not self._breaker.allow():
            return found
        wanted = [(index, part) for index in range(len(keys)) for part in sorted(set(parts))]
        deadline = time.monotonic() + self.promote_deadline_s
        damaged: list[tuple[int, int]] = []
        try:
            for start in range(0, len(wanted), PROMOTE_BATCH):
                if time.monotonic() > deadline:
                    raise TimeoutError("promote deadline passed")
                batch = wanted[start : start + PROMOTE_BATCH]
                pipe = self._client.pipeline(transaction=False)
                for index, part in batch:
                    pipe.get(redis_key(namespace, keys[index], part))
                values = pipe.execute(raise_on_error=False)
                for (index, part), value in zip(batch, values, strict=True):
                    if not isinstance(value, bytes):
                        continue  # absent, or an error for this key (e.g. MOVED): a miss
                    payload = _verified(namespace, keys[index], part, value)
                    if payload is None:
                        damaged.append((index, part))
                    else:
                        found[(index, part)] = payload
        except (*_FAILURES, TimeoutError):
            self._record_failure()
        else:
            self._breaker.record_success()
        if damaged:
            with self._lock:
                self.checksum_failures += len(damaged)
            for index, part in damaged:
                if time.monotonic() > deadline:
                    break  # the rest are dropped by a later Promote
                self._drop_damaged(namespace, keys[index], part)
        return found

    def _drop_damaged(self, namespace: bytes, key: bytes, part: int) -> None:
        """Remove a value that failed its checksum, so Lookup stops counting it, unless a put
        replaced it since it was read (WATCH: the removal is then not done). Best effort: a
        failure leaves it for the next Promote to find."""
        name = redis_key(namespace, key, part)
        with self._client.pipeline() as pipe:
            try:
                pipe.watch(name)
                value = pipe.get(name)
                if isinstance(value, bytes) and _verified(namespace, key, part, value) is None:
                    pipe.multi()
                    pipe.unlink(name)
                    pipe.execute()
            except _FAILURES as exc:  # WatchError included: replaced meanwhile
                log.debug("damaged value %r kept: %s", name, exc)

    def flush(self, timeout: float | None = None) -> bool:
        return self._queue.flush(timeout)

    def server_stats(self) -> list[BackendStats]:
        started = time.monotonic()
        try:
            info = self._client.info()
        except _FAILURES as exc:
            raise BackendUnavailable(f"redis at {self.address} did not answer: {exc}") from None
        keyspace = info.get(f"db{self._client.connection_pool.connection_kwargs.get('db', 0)}")
        return [
            BackendStats(
                address=self.address,
                role=f"redis {info.get('redis_mode', 'standalone')}",
                entries=int(keyspace["keys"]) if isinstance(keyspace, dict) else 0,
                bytes_used=int(info.get("used_memory", 0)),
                max_bytes=int(info.get("maxmemory", 0)),
                hits=int(info.get("keyspace_hits", 0)),
                misses=int(info.get("keyspace_misses", 0)),
                evictions=int(info.get("evicted_keys", 0)),
                rejected=0,
                uptime_s=float(info.get("uptime_in_seconds", 0)),
                version=str(info.get("valkey_version", info.get("redis_version", ""))),
                rtt_s=time.monotonic() - started,
            )
        ]

    def eviction_policy(self) -> str:
        """The server's maxmemory-policy (README: tierkv needs allkeys-lru); BackendUnavailable
        when it does not answer."""
        try:
            found = self._client.config_get("maxmemory-policy")
        except _FAILURES as exc:
            raise BackendUnavailable(f"redis at {self.address} did not answer: {exc}") from None
        return str(found.get("maxmemory-policy", ""))

    def clear(self, namespace: bytes) -> int:
        pattern = b"tierkv:%s:*" % namespace.hex().encode()
        try:
            # One key per UNLINK: a cluster node refuses several keys of different slots.
            pipe = self._client.pipeline(transaction=False)
            for key in self._client.scan_iter(match=pattern, count=1000):
                pipe.unlink(key)
            removed = sum(int(count) for count in pipe.execute())
        except _FAILURES as exc:
            raise BackendUnavailable(f"redis at {self.address} did not answer: {exc}") from None
        return removed

    def counters(self) -> dict[str, int | str]:
        with self._lock:
            mine: dict[str, int | str] = {
                "checksum_failures": self.checksum_failures,
                "failed_calls": self.failed_calls,
            }
        return {**self._queue.counters(), **mine}

    def close(self) -> None:
        self._queue.close(self.deadline_s)
        self._breaker.stop()
        self._client.close()

    def _send(self, batch: list[PendingPut]) -> int:
        """Store `batch` (Redis refuses none of it: 0), or raise."""
        pipe = self._client.pipeline(transaction=False)
        for put in batch:
            checksum = block_checksum(put.namespace, put.key, put.part, *put.pieces, hold_gil=True)
            value = b"".join((checksum.to_bytes(_CHECKSUM_BYTES, "little"), *put.pieces))
            pipe.set(redis_key(put.namespace, put.key, put.part), value)
        pipe.execute()
        return 0

    def _record_failure(self) -> None:
        with self._lock:
            self.failed_calls += 1
        self._breaker.record_failure()

    def _ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except _FAILURES:
            return False


def _verified(namespace: bytes, key: bytes, part: int, value: bytes) -> memoryview | None:
    """The payload of a stored value when its checksum matches the block's address; None when
    the value is damaged (too short to hold a checksum, or another checksum)."""
    if len(value) < _CHECKSUM_BYTES:
        return None
    view = memoryview(value)
    payload = view[_CHECKSUM_BYTES:]
    checksum = int.from_bytes(view[:_CHECKSUM_BYTES], "little")
    if block_checksum(namespace, key, part, payload, hold_gil=True) != checksum:
        return None
    return payload


class RedisClusterBackend(ShardedBackend):
    """A Redis Cluster: each block on the primary serving its hash slot, nodes in parallel."""

    def __init__(
        self, url: str, client_cfg: ClientConfig, security: SecurityConfig | None = None
    ) -> None:
        super().__init__(redact(url), threads=16)
        parts = urlsplit(url)
        self._options = connection_options(url, client_cfg, security)
        self._options.pop("db", None)  # a cluster has database 0 only
        self._client_cfg = client_cfg
        self._seeds = [(parts.hostname or "", parts.port or 6379)]
        self._nodes: dict[tuple[str, int], RedisBackend] = {}
        self._slots: list[tuple[str, int] | None] = [None] * 16384
        self._lock = threading.Lock()
        self._refreshed_at = 0.0
        self._refreshing = False
        self._load_slots()

    def owner(self, key: bytes) -> RedisBackend | None:
        node = self._slots[key_slot(key.hex().encode())]
        return None if node is None else self._nodes.get(node)

    def members(self) -> list[Backend]:
        with self._lock:
            return list(self._nodes.values())

    def server_stats(self) -> list[BackendStats]:
        """Each node's figures; BackendUnavailable when no node has answered CLUSTER SLOTS."""
        if not self.members():
            raise BackendUnavailable(f"no node of the cluster at {self.address} answered")
        return super().server_stats()

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        self._refresh_if_failing()
        return super().lookup(namespace, keys, parts)

    def promote(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts: Sequence[int],
        into: Into | None = None,
    ) -> dict[tuple[int, int], memoryview]:
        self._refresh_if_failing()
        return super().promote(namespace, keys, parts, into)

    def _refresh_if_failing(self) -> None:
        """Re-read the slot map in the background when a node's breaker is open (a failover)."""
        cooldown = self._client_cfg.breaker_cooldown_s
        with self._lock:
            failing = any(node.breaker_state == "open" for node in self._nodes.values())
            stale = time.monotonic() - self._refreshed_at > cooldown
            if not (failing or not self._nodes) or not stale or self._refreshing:
                return
            self._refreshing = True
        threading.Thread(target=self._load_slots, name="tierkv-cluster-slots", daemon=True).start()

    def _load_slots(self) -> None:
        """The slot map from the first node that answers CLUSTER SLOTS; unchanged if none does."""
        with self._lock:
            candidates = [*self._seeds, *self._nodes]
        try:
            for host, port in candidates:
                probe = redis.Redis(host=host, port=port, **self._options)
                try:
                    ranges = probe.execute_command("CLUSTER SLOTS")
                except _FAILURES:
                    continue
                finally:
                    probe.close()
                self._install(ranges)
                return
            log.warning("no node of the cluster at %s answered; its blocks miss", self.address)
        finally:
            with self._lock:
                self._refreshed_at = time.monotonic()
                self._refreshing = False

    def _install(self, ranges: list[Any]) -> None:
        slots: list[tuple[str, int] | None] = [None] * 16384
        for start, end, primary, *_replicas in ranges:
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            node = (host, int(primary[1]))
            with self._lock:
                if node not in self._nodes:
                    label = f"{self.address} node {format_address(*node)}"
                    self._nodes[node] = RedisBackend.connect(
                        *node, self._options, self._client_cfg, label
                    )
            slots[int(start) : int(end) + 1] = [node] * (int(end) - int(start) + 1)
        self._slots = slots
