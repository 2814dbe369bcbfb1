"""The Backend protocol every cold store implements.

A backend stores verified payloads under (namespace, key, part) and gives them back:
`put` never blocks, `lookup` and `promote` never raise and never wait past the client deadline
(any failure is a miss), `flush` waits for queued puts, `stats` reports each server behind it.

The reliability parts every backend shares (the circuit breaker and the put queue) are written
once, in tierkv/reliability.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tierkv.vault.bulk import Into
from tierkv.vault.client import VaultStats, VaultUnavailable

__all__ = ["Backend", "Into", "VaultStats", "VaultUnavailable"]


class Backend(Protocol):
    """What ColdTier needs from a cold store (a vault, Valkey / Redis, a set of shards)."""

    address: str
    """Where it is, for messages (never holds a password)."""

    def put(self, namespace: bytes, key: bytes, part: int, payload: bytes | memoryview) -> None:
        """Queue one payload and return at once; a full queue drops the oldest (counted)."""

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        """How many leading `keys` have every one of `parts` stored; 0 on any failure."""

    def promote(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts: Sequence[int],
        into: Into | None = None,
    ) -> dict[tuple[int, int], memoryview]:
        """(key index, part) → payload that passed its checksum; failures are absent.

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
