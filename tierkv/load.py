"""One load of ColdTier: Promote runs from each vault, whole keys handed to the consumer.

Call order: `Load(namespace, keys, parts_by_vault, consume, into, ...)`, then `run(backends)`
once, which returns the indices of the keys that could not be restored whole; `restored_bytes`
then says how many payload bytes the consumer took. What every load shares lives here too:
`decode_each` (the consumer that decodes each arrived block into its output) and
`SWITCH_INTERVAL_WHILE_LOADING` (Python's switch interval while loads run).

What a load does (ColdTier.load_blocks documents it for callers):

- each vault is asked in runs of keys, one Promote each: the first FIRST_PROMOTE_RUN_KEYS keys
  (or, with `into` and a vault that placed the payloads of its previous load, as many as
  PLACED_RUN_BYTES holds at that load's bytes per key), the next ones sized from the bytes per
  key seen so far to about PROMOTE_RUN_BYTES (PLACED_RUN_BYTES once the vault has placed a
  run's payloads: one that ignores `into`, as Redis or a file tier, is asked as without it);
- a run that returns nothing ends that vault's part of the load, and no run starts once
  `deadline_s` has passed since the load began: the keys not asked for fail;
- a key goes to `consume` once every part of it has arrived from every vault; small groups are
  consumed at once on the promoting thread, larger ones in tasks of about DECODE_TASK_BYTES on
  the decode threads, while the next run is on the wire; what no decode thread has started when
  every Promote has returned runs on the loading thread;
- a key fails when a part is missing, when `consume` refuses it, or when `consume` raises (every
  key of that call fails).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import Any

from tierkv.backends.base import Backend, renumbered
from tierkv.logs import get_logger
from tierkv.quant import PayloadError
from tierkv.transfer import Into, batched_by_size

log = get_logger(__name__)

PROMOTE_RUN_BYTES = 8 * 1024 * 1024
"""A load asks each vault for runs of keys of about this many payload bytes, one after the other,
so the blocks of one run decode while the next is on the wire."""
FIRST_PROMOTE_RUN_KEYS = 4
"""Keys of a load's first run (short, so decoding starts early; it also measures payload size)."""
PLACED_RUN_BYTES = 64 * 1024 * 1024
"""Runs from a vault that receives payloads in place (`into`) are about this many payload bytes:
there is nothing to overlap them with, so fewer round trips are all that counts. The first one
is sized from the payload bytes per key of the tier's previous load from that vault. A vault
that ignores `into` keeps PROMOTE_RUN_BYTES: its payloads are still decoded or copied while the
next run is on the wire, and a Redis answered a 64 MiB MGET slower than eight of 8 MiB."""
DECODE_TASK_BYTES = 2 * 1024 * 1024
"""Arrived payloads are decoded in tasks of about this many bytes (spread over the threads)."""
LOAD_SWITCH_INTERVAL_S = 0.0001
"""Python's switch interval while a load runs (it is 5 ms unless set). A load's threads give the
GIL back at every receive, checksum run and kernel, and each time they want it again a thread
busy in Python (an engine's) keeps it for up to the switch interval. With such a thread, 200
blocks of 512 KB (int8) restored in 355 ms at 5 ms, 87 ms at 0.1 ms (idle: about 60 ms), over
TLS (a receive per 16 KiB record) 15.7 s and 0.58 s; and the busy thread lost less of its own
progress per restore at 0.1 ms (about 45 ms of its time against 110 ms; over TLS 65 ms against
0.8 s). The interval only matters while threads contend for the GIL."""

Block = tuple[int, int, memoryview]
"""(key index, part, payload) of a block a load received."""
Consume = Callable[[list[Block]], set[int]]
"""consume(blocks) -> the key indices it could not restore (see ColdTier.load_blocks)."""
Sizes = dict[int, tuple[memoryview, int]]
"""id(first buffer) -> (that buffer, bytes of all its block's buffers), for the blocks a load
asked `into` to place (the buffer is kept alive, so its id names no other object)."""


class Load:
    """One call of ColdTier.load_blocks, from its first Promote to its last `consume`.

    `decoders` and `promoters` are the tier's thread pools; `key_bytes` its memory of the
    payload bytes per key of each backend's latest load that placed payloads (by id), read and
    updated here."""

    def __init__(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts_by_vault: Mapping[str, Sequence[int]],
        consume: Consume,
        into: Into | None,
        *,
        decoders: Executor,
        promoters: Executor,
        deadline_s: float,
        key_bytes: dict[int, int],
    ) -> None:
        self.namespace = namespace
        self.keys = keys
        self.parts_by_vault = parts_by_vault
        self.restored_bytes = 0
        """Payload bytes of the keys `consume` restored (placed payloads: what was placed)."""
        self._consume_blocks = consume
        self._sizes: Sizes = {}
        self._into = None if into is None else self._measured(into)
        self._decoders = decoders
        self._promoters = promoters
        self._deadline_s = deadline_s
        self._deadline = time.monotonic() + deadline_s
        self._key_bytes = key_bytes
        self._wanted = sum(len(parts) for parts in parts_by_vault.values())
        self._waiting: dict[int, list[Block]] = {}  # key index -> its parts arrived so far
        self._lock = threading.Lock()
        self._submitted: list[tuple[Future[set[int] | None], list[list[Block]]]] = []
        self._refused_here: list[set[int]] = []  # of calls made on a promoting thread

    def run(self, backends: Mapping[str, Backend]) -> set[int]:
        """Load every key from `backends` (by vault name, one per vault of `parts_by_vault`);
        the indices of the keys that could not be restored whole."""
        # The first vault is promoted from on this thread (no hand-off before the first
        # request leaves), any others on the promote threads meanwhile.
        vaults = list(self.parts_by_vault)
        elsewhere = {
            vault: self._promoters.submit(
                self._promote_runs, backends[vault], self.parts_by_vault[vault]
            )
            for vault in vaults[1:]
        }
        failed: set[int] = set()
        for vault in vaults:
            try:
                failed |= (
                    elsewhere[vault].result()
                    if vault in elsewhere
                    else self._promote_runs(backends[vault], self.parts_by_vault[vault])
                )
            except Exception:
                log.exception("promote from the %s vault failed; recomputing", vault)
                failed.update(range(len(self.keys)))
        # Every promote has returned, nothing is submitted any more: this thread runs the
        # calls no decode thread has started (waking one costs milliseconds on a busy machine).
        mine = [self._claimed(claim) for _, claim in self._submitted]
        for (future, _), result in zip(self._submitted, mine, strict=True):
            failed |= result if result is not None else (future.result() or set())
        return failed.union(*self._refused_here)

    def _promote_runs(self, backend: Backend, parts: Sequence[int]) -> set[int]:
        """Promote the keys run by run, handing each run's payloads to `_arrived`, until a run
        returns nothing or the deadline has passed; the indices of the keys with a part that
        did not arrive."""
        keys = self.keys
        missing: set[int] = set()
        received = 0
        run_bytes, start, run = PROMOTE_RUN_BYTES, 0, FIRST_PROMOTE_RUN_KEYS
        if self._into is not None and self._key_bytes.get(id(backend)):
            run_bytes = PLACED_RUN_BYTES
            run = max(1, run_bytes // self._key_bytes[id(backend)])
        while start < len(keys):
            if time.monotonic() > self._deadline:
                log.warning(
                    "load of %d blocks passed its %.1f s deadline after %d; recomputing the rest",
                    len(keys),
                    self._deadline_s,
                    start,
                )
                break
            stop = min(len(keys), start + run)
            run_into = renumbered(self._into, range(start, stop)) if start else self._into
            found = backend.promote(self.namespace, keys[start:stop], parts, run_into)
            if not found:
                break
            if len(found) < (stop - start) * len(parts):  # it holds only (index, part) asked for
                missing.update(
                    start + index
                    for index, part in itertools.product(range(stop - start), parts)
                    if (index, part) not in found
                )
            blocks = [(start + index, part, payload) for (index, part), payload in found.items()]
            if self._into is not None and id(blocks[0][2]) in self._sizes:
                run_bytes = PLACED_RUN_BYTES
            received += sum([self._size(payload) for _, _, payload in blocks])
            self._arrived(blocks)
            start = stop
            run = max(1, run_bytes * start // max(1, received))
        if received and run_bytes == PLACED_RUN_BYTES:
            self._key_bytes[id(backend)] = received // start
        elif received:  # it no longer places (another codec): its next load starts short
            self._key_bytes.pop(id(backend), None)
        missing.update(range(start, len(keys)))
        return missing

    def _arrived(self, blocks: list[Block]) -> None:
        """Hand on the keys whose every part has now arrived (a partial key is recomputed
        anyway, decoding it would be wasted work)."""
        whole: list[list[Block]] = []
        if self._wanted > 1:
            with self._lock:
                for block in blocks:
                    parts = self._waiting.setdefault(block[0], [])
                    parts.append(block)
                    if len(parts) == self._wanted:
                        whole.append(self._waiting.pop(block[0]))
            blocks = [block for parts in whole for block in parts]
        if not blocks:
            return
        if _payload_bytes(blocks) <= DECODE_TASK_BYTES:
            # Little to do (a short run, or payloads placed in their destination): here, at
            # once, costs less than waking a decode thread (milliseconds when busy).
            self._refused_here.append(self._consume(blocks))
            return
        whole = whole or [[block] for block in blocks]
        for batch in batched_by_size(whole, _payload_bytes, DECODE_TASK_BYTES):
            claim = [[block for parts in batch for block in parts]]
            self._submitted.append((self._decoders.submit(self._claimed, claim), claim))

    def _claimed(self, claim: list[list[Block]]) -> set[int] | None:
        """`_consume` the blocks in `claim` unless another thread took them first (None):
        list.pop is atomic, so each call runs once, on a decode thread or the loading thread."""
        try:
            blocks = claim.pop()
        except IndexError:
            return None
        return self._consume(blocks)

    def _consume(self, blocks: list[Block]) -> set[int]:
        """`consume(blocks)`, counting the payload bytes of the keys it restored; every key
        fails when it raises."""
        try:
            failed = self._consume_blocks(blocks)
        except Exception:
            log.exception("restoring %d arrived blocks failed; recomputing them", len(blocks))
            failed = {index for index, _, _ in blocks}
        restored = sum([self._size(payload) for index, _, payload in blocks if index not in failed])
        with self._lock:
            self.restored_bytes += restored
        return failed

    def _measured(self, into: Into) -> Into:
        """`into` that notes in `_sizes`, for each block it places, its first buffer and the
        bytes of all (the payload's length when the backend placed it)."""

        def placing(
            indices: Sequence[int], parts: Sequence[int]
        ) -> dict[tuple[int, int], list[memoryview]]:
            placement = into(indices, parts)
            for buffers in placement.values():
                self._sizes[id(buffers[0])] = (buffers[0], sum(map(len, buffers)))
            return placement

        return placing

    def _size(self, payload: memoryview) -> int:
        """Bytes of an arrived payload (of all its buffers, when `into` placed it)."""
        placed = self._sizes.get(id(payload))
        return len(payload) if placed is None else placed[1]


def _payload_bytes(blocks: list[Block]) -> int:
    return sum(len(payload) for _, _, payload in blocks)


class SwitchInterval:
    """A context manager that lowers Python's switch interval to `seconds` while at least one
    thread is inside it, then puts back the interval it found (unless someone changed it
    meanwhile). The interval is the process's, so one instance serves every tier."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._inside = 0
        self._found: float | None = None  # the interval to put back, when this one lowered it
        self._set = 0.0  # the interval as this one set it

    def __enter__(self) -> None:
        with self._lock:
            if self._inside == 0 and sys.getswitchinterval() > self.seconds:
                self._found = sys.getswitchinterval()
                sys.setswitchinterval(self.seconds)
                self._set = sys.getswitchinterval()
            self._inside += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0 and self._found is not None:
                if sys.getswitchinterval() == self._set:
                    sys.setswitchinterval(self._found)
                self._found = None


SWITCH_INTERVAL_WHILE_LOADING = SwitchInterval(LOAD_SWITCH_INTERVAL_S)


def decode_each(
    blocks: list[Block],
    out_for: Callable[[int, int], Any],
    decoder: Callable[[memoryview, Any], None],
) -> set[int]:
    """Decode each arrived block with `decoder(payload, out_for(index, part))`; the key
    indices of those that failed (each logged)."""
    failed = set()
    for index, part, payload in blocks:
        try:
            decoder(payload, out_for(index, part))
        except PayloadError as exc:
            log.warning("block %d part %d does not decode (%s); recomputing it", index, part, exc)
            failed.add(index)
        except Exception:
            log.exception("decoding block %d part %d failed; recomputing it", index, part)
            failed.add(index)
    return failed
