"""The Backend protocol every cold store implements.

A backend stores verified payloads under (namespace, key, part) and gives them back:
`put` never blocks, `lookup` and `promote` never raise and never wait past the client deadline
(any failure is a miss), `flush` waits for queued puts, `server_stats` reports each server
behind it. Its own types live here or below it (tierkv.transfer's `Into`, tierkv.checksum), so
no backend depends on another: `BackendStats` / `StorageTierStats` (what a server reports),
`BackendUnavailable` (a management call found a server down).

The reliability parts every backend shares (the circuit breaker and the put queue) are written
once, in tierkv/reliability.py.
`renumbered` maps a caller's `into` onto a Promote of some of its keys (a shard's, a run's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from tierkv.errors import TierKVError
from tierkv.reliability import PutPayload
from tierkv.transfer import Into


class BackendUnavailable(TierKVError, RuntimeError):
    """A server behind a backend did not answer a management call (stats, delete, clear)."""


class StorageTierStats(NamedTuple):
    """One storage tier of a server, RAM or disk (see TierStats in vault.proto)."""

    entries: int
    bytes_used: int
    max_bytes: int
    hits: int
    reads_per_s: float
    evictions: int
    corrupt: int
    queued_bytes: int
    kept: int
    live_bytes: int = 0  # disk: bytes_used less dead (overwritten, deleted) records


@dataclass(frozen=True)
class BackendStats:
    """What one server behind a backend reports about itself, plus the round trip the call took
    (fields a store does not know stay at their defaults)."""

    address: str
    role: str
    entries: int
    bytes_used: int
    max_bytes: int  # 0 = unlimited
    hits: int
    misses: int
    evictions: int
    rejected: int
    uptime_s: float
    version: str
    rtt_s: float
    ram: StorageTierStats | None = None
    disk: StorageTierStats | None = None  # None: the server has no disk tier
    auth_required: bool = False  # the server needs a token (and accepted ours)
    insecure: bool = False  # a vault started --insecure beyond loopback: anyone on the LAN may call
    tls: bool = False
    tenant: str = ""  # ours, on a vault of several tenants (the counters are its own)


class Backend(Protocol):
    """What ColdTier needs from a cold store (a vault, Valkey / Redis, a set of shards)."""

    address: str
    """Where it is, for messages (never holds a password)."""

    def put(
        self,
        namespace: bytes,
        key: bytes,
        part: int,
        payload: PutPayload,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Queue one payload and return at once; a full queue drops the oldest (counted).
        Pieces (a tuple) are sent without a copy and must not change until `release()`, called
        once whatever becomes of the put (reliability.PutQueue.put)."""

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        """How many leading `keys` have every one of `parts` stored; 0 on any failure."""

    def promote(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts: Sequence[int],
        into: Into | None = None,
    ) -> dict[tuple[int, int], memoryview]:
        """(key index, part) → payload that passed its checksum, for pairs asked for only;
        failures are absent.

        A backend may receive payloads straight into the buffers `into(key indices, parts)`
        gives for them (a vault's bulk path does), and then returns each as the first
        of its buffers, that very object; others ignore `into`."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued puts; False on timeout or when a put was lost since the last flush."""

    def server_stats(self) -> list[BackendStats]:
        """One row per server behind this backend; raises BackendUnavailable when one is down."""

    def clear(self, namespace: bytes) -> int:
        """Remove all of `namespace`; the entries removed. Raises BackendUnavailable."""

    def counters(self) -> dict[str, int | str]:
        """Client-side counters (dropped / failed / stored puts, breaker state...)."""

    def close(self) -> None:
        """Deliver what is queued (up to one deadline), then release connections and threads."""


def renumbered(into: Into | None, indices: Sequence[int]) -> Into | None:
    """`into` for a Promote of keys[indices] (a shard's share, a load's run): the key index i
    of that Promote is indices[i] of the caller's."""
    if into is None:
        return None
    place = {index: at for at, index in enumerate(indices)}

    def member_into(
        places: Sequence[int], parts: Sequence[int]
    ) -> dict[tuple[int, int], list[memoryview]]:
        found = into([indices[at] for at in places], parts)
        return {(place[index], part): bufs for (index, part), bufs in found.items()}

    return member_into
