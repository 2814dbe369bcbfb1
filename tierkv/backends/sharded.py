"""Blocks spread over several backends: each block (all its parts) lives on exactly one of them.

`ShardedBackend` does the fan-out that every spread needs: a call is split by owner, sent to the
owners in parallel (one call, so one round trip, per backend touched) and the answers are merged;
the hit length is the longest prefix present across them. A backend that is down answers "miss"
for its own blocks only. Subclasses say who owns a block key: `WeightedShards` by weighted
rendezvous hashing (adding or removing a backend moves only its share of blocks), the Redis
Cluster backend by hash slot.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import xxhash

from tierkv.addresses import redact
from tierkv.backends.base import Backend, BackendStats, renumbered
from tierkv.reliability import PutPayload
from tierkv.transfer import Into

_TWO_64 = float(2**64)
T = TypeVar("T")


class ShardedBackend:
    """Fan-out and merge over member backends; subclasses implement `owner` and `members`."""

    def __init__(self, address: str, threads: int) -> None:
        self.address = address
        self.unrouted_puts = 0
        """Puts with no owner (a cluster whose slot map is unknown): dropped."""
        self._unrouted_since_flush = False
        self._unrouted_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="tierkv-shards")

    def owner(self, key: bytes) -> Backend | None:
        """The member that holds `key`'s block; None when none can (its blocks miss)."""
        raise NotImplementedError

    def members(self) -> list[Backend]:
        raise NotImplementedError

    def put(
        self,
        namespace: bytes,
        key: bytes,
        part: int,
        payload: PutPayload,
        release: Callable[[], None] | None = None,
    ) -> None:
        backend = self.owner(key)
        if backend is None:
            with self._unrouted_lock:
                self.unrouted_puts += 1
                self._unrouted_since_flush = True
            if release is not None:
                release()
            return
        backend.put(namespace, key, part, payload, release)

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        groups = self._split(keys)
        present = self._fan_out(
            groups,
            lambda backend, indices: backend.lookup(namespace, [keys[i] for i in indices], parts),
        )
        position: dict[int, tuple[int, int]] = {}  # key index → (group, place in the group)
        for group, (_, indices) in enumerate(groups):
            for place, index in enumerate(indices):
                position[index] = (group, place)
        for index in range(len(keys)):
            if index not in position:
                return index
            group, place = position[index]
            if place >= present[group]:
                return index
        return len(keys)

    def promote(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts: Sequence[int],
        into: Into | None = None,
    ) -> dict[tuple[int, int], memoryview]:
        groups = self._split(keys)

        def promote(backend: Backend, indices: list[int]) -> dict[tuple[int, int], memoryview]:
            return backend.promote(
                namespace, [keys[i] for i in indices], parts, renumbered(into, indices)
            )

        answers = self._fan_out(groups, promote)
        found: dict[tuple[int, int], memoryview] = {}
        for (_, indices), answer in zip(groups, answers, strict=True):
            for (place, part), payload in answer.items():
                found[(indices[place], part)] = payload
        return found

    def flush(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        flushed = True
        for backend in self.members():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            flushed = backend.flush(remaining) and flushed
        with self._unrouted_lock:
            lost, self._unrouted_since_flush = self._unrouted_since_flush, False
        return flushed and not lost

    def server_stats(self) -> list[BackendStats]:
        return [row for backend in self.members() for row in backend.server_stats()]

    def clear(self, namespace: bytes) -> int:
        return sum(backend.clear(namespace) for backend in self.members())

    def counters(self) -> dict[str, int | str]:
        """Numeric counters summed over the members; `breaker`: how many are open."""
        sums: dict[str, int] = {"unrouted_puts": self.unrouted_puts}
        members = [backend.counters() for backend in self.members()]
        for counters in members:
            for name, value in counters.items():
                if isinstance(value, int):
                    sums[name] = sums.get(name, 0) + value
        open_breakers = sum(counters.get("breaker") == "open" for counters in members)
        return {**sums, "breaker": f"{open_breakers}/{len(members)} open"}

    def close(self) -> None:
        for backend in self.members():
            backend.close()
        self._pool.shutdown(wait=True)

    def _split(self, keys: Sequence[bytes]) -> list[tuple[Backend, list[int]]]:
        """Key indices grouped by owner, in key order within each group; unowned keys left out."""
        groups: dict[int, tuple[Backend, list[int]]] = {}
        for index, key in enumerate(keys):
            backend = self.owner(key)
            if backend is not None:
                groups.setdefault(id(backend), (backend, []))[1].append(index)
        return list(groups.values())

    def _fan_out(
        self,
        groups: list[tuple[Backend, list[int]]],
        call: Callable[[Backend, list[int]], T],
    ) -> list[T]:
        """`call` for every group, in parallel (the calling thread takes one of them)."""
        if not groups:
            return []
        futures: list[Future[T]] = [self._pool.submit(call, *group) for group in groups[1:]]
        first = call(*groups[0])
        return [first, *(future.result() for future in futures)]


class WeightedShards(ShardedBackend):
    """Several backends, each block on the one with the highest weighted rendezvous score.

    Scores are keyed by each backend's address (without credentials), so the placement does not
    depend on the order the backends are listed in.
    """

    def __init__(self, backends: Sequence[tuple[Backend, float]]) -> None:
        if not backends:
            raise ValueError("a sharded backend needs at least one backend")
        super().__init__(", ".join(backend.address for backend, _ in backends), len(backends))
        self._backends = [backend for backend, _ in backends]
        self._weights = [float(weight) for _, weight in backends]
        self._seeds = [xxhash.xxh3_64_intdigest(redact(b.address).encode()) for b in self._backends]

    def owner(self, key: bytes) -> Backend:
        return self._backends[rendezvous_owner(key, self._seeds, self._weights)]

    def members(self) -> list[Backend]:
        return list(self._backends)


def rendezvous_owner(key: bytes, seeds: Sequence[int], weights: Sequence[float]) -> int:
    """Index of the member with the highest score -weight / ln(u), u = hash(key, seed) in (0, 1).

    Each member wins a block with probability weight / sum(weights), independently of the others.
    """
    best, best_score = 0, -math.inf
    for index, (seed, weight) in enumerate(zip(seeds, weights, strict=True)):
        unit = (xxhash.xxh3_64_intdigest(key, seed=seed) + 0.5) / _TWO_64
        score = -weight / math.log(unit)
        if score > best_score:
            best, best_score = index, score
    return best
