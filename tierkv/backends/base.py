"""The Backend protocol every cold store implements.

A backend stores verified payloads under (namespace, key, part) and gives them back:
`put` never blocks, `lookup` and `promote` never raise and never wait past the client deadline
(any failure is a miss), `flush` waits for queued puts, `stats` reports each server behind it.

The reliability parts every backend shares (the circuit breaker and the put queue) are written
once, in tierkv/reliability.py.
`renumbered` maps a caller's `into` onto a Promote of some of its keys (a shard's, a run's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from tierkv.reliability import PutPayload
from tierkv.vault.bulk import Into
from tierkv.vault.client import VaultStats, VaultUnavailable

__all__ = ["Backend", "Into", "VaultStats", "VaultUnavailable", "renumbered"]


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

    def stats(self) -> list[VaultStats]:
        """One row per server behind this backend; raises VaultUnavailable when one is down."""

    def clear(self, namespace: bytes) -> int:
        """Remove all of `namespace`; the entries removed. Raises VaultUnavailable."""

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
