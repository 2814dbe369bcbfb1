"""ColdTier: the one API both engine adapters use to store blocks in the vaults and load them back.

It joins a codec, one backend per vault role ("kv" for attention KV, "ssm" for linear-attention /
SSM state; a backend is a vault, Valkey / Redis, or several spread by weight) and the block keys.
Engines differ only in how blocks leave and enter their caches; everything that happens to a
block between those two points lives here.

Call order, per engine request:
1. `lookup(namespace, keys, parts_by_vault)` -> how many leading blocks every vault holds.
2. `load(namespace, keys[:hit], parts_by_vault, out_for)` -> the key indices that failed; the
   engine recomputes those (and everything after the first one). `load_blocks` hands the
   received payloads to a consumer instead (the data mover writes lossless ones straight from
   the receive buffers into the paged KV buffer).
and, whenever the engine lets go of a block:
3. `store(namespace, key, part, block, dtype, vault)` -> returns at once; encoding and sending
   happen on background threads. A lossless block is not copied: its payload is a header and
   the block's own memory, sent as they are, and the tier owns the block until it is sent.
With a sealer (`[security] data_key_file`), every payload is sealed (tierkv/seal.py: encrypted
and bound to its namespace, key and part) before its backend sees it, and opened before the
consumer sees it; one that does not open is a miss, counted as `open_failures`. Sealed payloads
are received into the client's buffers and opened from there (never `into` the engine's).
Blocks for the "kv" vault use the configured codec. State for the "ssm" vault is always stored
lossless: the engine feeds it forward through every later token, so a quantization error there
would compound instead of staying in one block.
`flush()` waits for stores to be acknowledged (tests, shutdown); `close()` ends everything.
"""

from __future__ import annotations

import functools
import operator
import resource
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tierkv.backends import open_backend
from tierkv.backends.base import Backend
from tierkv.backends.security import check_client_security
from tierkv.config import KV_VAULT, VAULT_ROLE, TierKVConfig
from tierkv.heap import keep_freed_memory
from tierkv.load import SWITCH_INTERVAL_WHILE_LOADING, Block, Consume, Load, decode_each
from tierkv.logs import get_logger
from tierkv.quant import (
    DTYPES,
    Codec,
    NonFiniteError,
    decode_into,
    encode_block,
    get_codec,
)
from tierkv.quant import warmup as warmup_codecs
from tierkv.quant.kernels import target_name
from tierkv.quant.lossless import LosslessCodec
from tierkv.quant.pair import is_pair, parse_pair
from tierkv.quant.payload import parse_header
from tierkv.reliability import PutPayload, payload_bytes
from tierkv.seal import OVERHEAD_BYTES, Sealer, SealError, block_address
from tierkv.sizes import format_size
from tierkv.transfer import RECEIVE_BUFFERS, Into, batched_by_size

log = get_logger(__name__)

DEFAULT_MAX_PENDING_ENCODE_BYTES = 256 * 1024 * 1024
STARTING_THREADS_S = 5.0
"""How long the restore path's threads may take to start (a busy machine; later a restore
starts what did not)."""


@dataclass
class TierStats:
    """Counters of one ColdTier (cumulative since it started). A block stored is counted once
    as queued (handed to its backend after encoding), and later, in `ColdTier.stats()`, as
    acknowledged (the vault stored it), rejected (the vault refused it) or dropped (the queue or
    a dead vault lost it); until then it is pending."""

    queued_blocks: int = 0
    queued_raw_bytes: int = 0
    queued_payload_bytes: int = 0
    skipped_nonfinite: int = 0
    dropped_backpressure: int = 0
    encode_errors: int = 0
    lookups: int = 0
    lookup_hit_blocks: int = 0
    loaded_blocks: int = 0
    loaded_payload_bytes: int = 0
    load_failures: int = 0
    sealed_blocks: int = 0
    open_failures: int = 0
    """Blocks that arrived but did not open under the data keys (changed, moved, another
    tenant's, not sealed): misses, recomputed."""


class ColdTier:
    """Codec + backends + keys: store blocks, find the longest stored prefix, load it back."""

    def __init__(
        self,
        codec: Codec,
        vaults: Mapping[str, Backend],
        *,
        min_cosine: float = 0.0,
        encode_threads: int = 2,
        max_pending_encode_bytes: int = DEFAULT_MAX_PENDING_ENCODE_BYTES,
        load_deadline_s: float = 30.0,
        sealer: Sealer | None = None,
    ) -> None:
        self.codec = codec
        self.sealer = sealer
        """Seals what is stored and opens what is loaded (None: payloads as they are)."""
        self.load_deadline_s = load_deadline_s
        """No further Promote run of a load starts after this many seconds (see `load`)."""
        self._lossless = get_codec("none", group_size=codec.group_size)
        self.vaults = dict(vaults)
        self.min_cosine = min_cosine
        self.max_pending_encode_bytes = max_pending_encode_bytes
        self._pending_encode_bytes = 0
        self._lock = threading.Lock()
        self._stats = TierStats()
        self._encoders = ThreadPoolExecutor(encode_threads, thread_name_prefix="tierkv-encode")
        self._decoders = ThreadPoolExecutor(encode_threads, thread_name_prefix="tierkv-decode")
        self._promoters = ThreadPoolExecutor(
            max(1, len(self.vaults)), thread_name_prefix="tierkv-promote"
        )
        self._threads = {self._decoders: encode_threads, self._promoters: max(1, len(self.vaults))}
        """The restore path's executors and their threads (`fill_receive_pool` starts them)."""
        self._encoding: set[Future[None]] = set()
        self._key_bytes: dict[int, int] = {}
        """Per backend (its id), payload bytes per key of its latest load (sizes the first
        run of the next one that places payloads)."""
        self.warmup_s = 0.0
        """Seconds `warm_up` spent compiling or loading the codec kernels."""
        self.warmed_codecs: tuple[str, ...] = ()
        """The codecs whose encoders `warm_up` compiled."""
        self.pool_bytes = 0
        """Bytes of receive buffers the process holds mapped and touched (`fill_receive_pool`)."""
        self.pool_s = 0.0
        """Seconds `fill_receive_pool` spent mapping and touching them."""

    @classmethod
    def from_config(cls, cfg: TierKVConfig, warm_dtypes: Sequence[str] = DTYPES) -> ColdTier:
        """A tier with the configured codec, a backend for each configured vault role, and a
        sealer of `[security] data_key_file`'s keys when it is set (ConfigError naming the file
        when it holds no valid keys). `[security]` is checked first, whatever the backends
        (backends.security.check_client_security: e.g. a data key file others may read).

        The kernels of that codec and of the lossless one are compiled (or loaded from Numba's
        cache) for `warm_dtypes` first, so no request pays for it; `warmup_s` says how long that
        took. Pass the engine's KV dtypes, or none for a side that never encodes or decodes.
        `[client] receive_pool_bytes` of receive buffers are mapped and touched, so the first
        restore runs as fast as the next ones; the start-up line logs what that cost. Freed
        memory stays in the process up to `[client] kept_freed_bytes` per malloc arena
        (tierkv.heap), so encodes and restores write into mapped pages too.
        """
        started = time.perf_counter()
        check_client_security(cfg.security)
        vaults = {
            vault: open_backend(cfg.cluster.endpoints(vault), cfg.client, cfg.security)
            for vault in VAULT_ROLE
            if cfg.cluster.endpoints(vault)
        }
        codec = get_codec(cfg.compression.codec_name, group_size=cfg.compression.group_size)
        key_file = cfg.security.data_key_file
        tier = cls(
            codec,
            vaults,
            min_cosine=cfg.compression.min_cosine,
            load_deadline_s=cfg.client.promote_deadline_ms / 1000,
            sealer=Sealer.from_file(key_file) if key_file else None,
        )
        tier.fill_receive_pool(cfg.client.receive_pool_bytes)
        kept = keep_freed_memory(cfg.client.kept_freed_bytes)
        if warm_dtypes:
            tier.warm_up(warm_dtypes)
        log.info(
            "cold tier started in %.2f s: %s of receive buffers mapped and touched in %.2f s,"
            " freed memory kept %s, kernels (built for %s) %.2f s; process resident peak %s",
            time.perf_counter() - started,
            format_size(tier.pool_bytes),
            tier.pool_s,
            f"up to {format_size(cfg.client.kept_freed_bytes)} per arena"
            if kept
            else "as the C library does",
            target_name(),
            tier.warmup_s,
            format_size(peak_resident_bytes()),
        )
        return tier

    def fill_receive_pool(self, total_bytes: int) -> int:
        """Map and touch receive buffers until the process's pool holds `total_bytes` (see
        transfer.ReceiveBuffers.fill) and start the restore path's threads (their stacks, too,
        are touched when they start); the bytes the pool holds, also kept in `pool_bytes` with
        the seconds taken in `pool_s`."""
        started = time.perf_counter()
        for executor, count in self._threads.items():
            barrier = threading.Barrier(count)  # each task waits for the others: one per thread
            wait([executor.submit(barrier.wait, STARTING_THREADS_S) for _ in range(count)])
        self.pool_bytes = RECEIVE_BUFFERS.fill(total_bytes)
        self.pool_s = time.perf_counter() - started
        return self.pool_bytes

    def warm_up(
        self, dtypes: Sequence[str], largest_block_bytes: int | None = None, *, state: bool = True
    ) -> float:
        """Compile (or load from Numba's cache) what storing and loading blocks of `dtypes`
        needs: this tier's codec, the lossless encoder when something is stored lossless (the
        "ssm" vault's state unless `state` is False, the min_cosine fallback), the fidelity
        check with min_cosine, and the multi-threaded builds unless `largest_block_bytes` is
        too small to use them (lossless decoding needs no kernel). Returns and remembers
        (`warmup_s`) the seconds taken."""
        codecs = [self.codec.name]
        if state or self.min_cosine > 0:
            codecs.append("none")
        self.warmed_codecs = tuple(dict.fromkeys(codecs))
        self.warmup_s = warmup_codecs(
            self.warmed_codecs,
            dtypes,
            with_fidelity=self.min_cosine > 0,
            largest_block_bytes=largest_block_bytes,
        )
        return self.warmup_s

    def store(
        self,
        namespace: bytes,
        key: bytes,
        part: int,
        block: np.ndarray,
        dtype: str | None = None,
        vault: str = KV_VAULT,
        on_done: Callable[[], None] | None = None,
        kv_split: tuple[int, int] | None = None,
        sink_tokens: tuple[int, int] | None = None,
    ) -> None:
        """Encode `block` and send it to `vault` in the background; never blocks.

        The tier owns `block` until it calls `on_done()` (once, when the block has been encoded,
        dropped or failed, and for a lossless block, which is sent from its own memory, when its
        put is done; pass a staging copy, not engine memory). When more than the
        pending-encode budget is already waiting, the block is dropped and counted.
        `kv_split`: (axis, keys along it) where the block's keys end and its values begin; a
        K/V pair codec needs it (without one the block is not stored). `sink_tokens`: (token
        axis, count) of the block's first tokens a sink codec keeps lossless: SINK_TOKENS for a
        sequence's first block, 0 for the others (see tierkv.quant.sinks).
        """
        client = self._client(vault)
        with self._lock:
            dropped = self._pending_encode_bytes + block.nbytes > self.max_pending_encode_bytes
            if dropped:
                self._stats.dropped_backpressure += 1
            else:
                self._pending_encode_bytes += block.nbytes
        if dropped:
            if on_done is not None:
                on_done()
            return
        future = self._encoders.submit(
            self._encode_and_put,
            vault,
            client,
            namespace,
            key,
            part,
            block,
            dtype,
            on_done,
            kv_split,
            sink_tokens,
        )
        with self._lock:
            self._encoding.add(future)
        future.add_done_callback(self._forget_encoding)

    def lookup(
        self, namespace: bytes, keys: Sequence[bytes], parts_by_vault: Mapping[str, Sequence[int]]
    ) -> int:
        """How many leading `keys` have every part present in every vault (0 on any failure)."""
        if not keys or not parts_by_vault:
            return 0
        hit = min(
            self._client(vault).lookup(namespace, keys, parts)
            for vault, parts in parts_by_vault.items()
        )
        with self._lock:
            self._stats.lookups += 1
            self._stats.lookup_hit_blocks += hit
        return hit

    def load(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts_by_vault: Mapping[str, Sequence[int]],
        out_for: Callable[[int, int], Any],
        decoder: Callable[[memoryview, Any], None] = decode_into,
    ) -> set[int]:
        """Fetch every part of every key and decode into `out_for(i, part)` with
        `decoder(payload, out)`: by default the Numba codecs into numpy arrays
        (`tierkv.quant.torch_ops.decode_into` decodes into torch tensors on their device).
        `load_blocks` with `decode_each` as the consumer; returns the indices of the keys that
        could not be restored whole, whose outputs must be treated as garbage."""
        return self.load_blocks(
            namespace, keys, parts_by_vault, lambda blocks: decode_each(blocks, out_for, decoder)
        )

    def load_blocks(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts_by_vault: Mapping[str, Sequence[int]],
        consume: Consume,
        into: Into | None = None,
    ) -> set[int]:
        """Fetch every part of every key and hand the payloads to `consume` as they arrive.

        Each vault is asked in runs of keys of about PROMOTE_RUN_BYTES (one Promote each, the
        first run short). Keys whose every part has arrived go to `consume(blocks)` (a list of
        (key index, part, payload), all parts of a key in one call) on the decode threads, in
        calls of about DECODE_TASK_BYTES, while the next run is on the wire; it returns the key
        indices it could not restore. A run that returns nothing ends the vault's load (it is
        down or lost the rest: no point in waiting for the remaining runs), and no run starts
        once `load_deadline_s` has passed since the load began, so a vault that answers each
        run slowly costs at most that plus one Promote deadline, not one deadline per run.
        Returns the indices of the keys that could not be restored whole (a part missing,
        failing its checksum or refused by `consume`).

        With `into` (see Backend.promote), payloads the backend receives straight into the
        buffers `into(key indices, parts)` gives reach `consume` as the first of those
        buffers; runs from a backend that placed a run's payloads are then about
        PLACED_RUN_BYTES (the first one too when its previous load placed them), from one that
        ignores `into` about PROMOTE_RUN_BYTES, as without it.

        While it runs, Python's switch interval is LOAD_SWITCH_INTERVAL_S. (The constants named
        here, and the load itself, are in tierkv/load.py.)
        """
        with SWITCH_INTERVAL_WHILE_LOADING:
            return self._load_blocks(namespace, keys, parts_by_vault, consume, into)

    def _load_blocks(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts_by_vault: Mapping[str, Sequence[int]],
        consume: Consume,
        into: Into | None,
    ) -> set[int]:
        if self.sealer is not None:
            consume = functools.partial(self._open_then, self.sealer, namespace, keys, consume)
            into = None
        load = Load(
            namespace,
            keys,
            parts_by_vault,
            consume,
            into,
            decoders=self._decoders,
            promoters=self._promoters,
            deadline_s=self.load_deadline_s,
            key_bytes=self._key_bytes,
        )
        failed = load.run({vault: self._client(vault) for vault in parts_by_vault})
        with self._lock:
            self._stats.loaded_blocks += len(keys) - len(failed)
            self._stats.load_failures += len(failed)
            self._stats.loaded_payload_bytes += load.restored_bytes
        return failed

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every stored block is encoded and acknowledged by its vault."""
        with self._lock:
            pending = list(self._encoding)
        _, not_done = wait(pending, timeout=timeout)
        if not_done:
            return False
        return all(client.flush(timeout) for client in self.vaults.values())

    def stats(self) -> dict[str, int]:
        """The tier's counters as a plain dict, with what became of the queued blocks, summed
        over the backends: `acknowledged_blocks`, `rejected_blocks`, `dropped_blocks`."""
        with self._lock:
            counters = asdict(self._stats)
        outcomes = {
            "acknowledged_blocks": ("stored_puts",),
            "rejected_blocks": ("rejected_puts",),
            "dropped_blocks": ("dropped_puts", "failed_puts"),
        }
        backends = [backend.counters() for backend in self.vaults.values()]
        for name, sources in outcomes.items():
            counters[name] = sum(
                int(found.get(source, 0)) for found in backends for source in sources
            )
        return counters

    def close(self) -> None:
        """Stop the background threads and close the vault connections."""
        self._encoders.shutdown(wait=True)
        self._decoders.shutdown(wait=True)
        self._promoters.shutdown(wait=True)
        for client in self.vaults.values():
            client.close()

    def _client(self, vault: str) -> Backend:
        try:
            return self.vaults[vault]
        except KeyError:
            raise ValueError(
                f"no {vault!r} vault is configured (configured: {sorted(self.vaults) or 'none'})"
            ) from None

    def _forget_encoding(self, future: Future[None]) -> None:
        with self._lock:
            self._encoding.discard(future)

    def stored_form(
        self,
        block: np.ndarray,
        dtype: str | None = None,
        vault: str = KV_VAULT,
        kv_split: tuple[int, int] | None = None,
        sink_tokens: tuple[int, int] | None = None,
    ) -> PutPayload:
        """`block` as `store` hands it to `vault`'s backend, before sealing: stored lossless (the
        "ssm" vault's state, or the lossless codec), its header and the block's own memory (no
        copy); else encoded by the codec (`encode_block`: the min_cosine fallback, `kv_split`,
        `sink_tokens`).
        NonFiniteError: the block holds NaN or infinity."""
        codec = self.codec if vault == KV_VAULT else self._lossless
        if isinstance(codec, LosslessCodec):
            return codec.encode_pieces(block, dtype)
        return encode_block(codec, block, dtype, self.min_cosine, kv_split, sink_tokens)

    def stored_forms(
        self, blocks: Sequence[np.ndarray], kv_split: tuple[int, int] | None = None
    ) -> list[PutPayload]:
        """stored_form of each KV block (keys and values split at `kv_split`), in order, encoded
        on the tier's encode threads as `store` encodes them."""
        return list(
            self._encoders.map(lambda block: self.stored_form(block, kv_split=kv_split), blocks)
        )

    def _encode_and_put(
        self,
        vault: str,
        client: Backend,
        namespace: bytes,
        key: bytes,
        part: int,
        block: np.ndarray,
        dtype: str | None,
        on_done: Callable[[], None] | None,
        kv_split: tuple[int, int] | None,
        sink_tokens: tuple[int, int] | None,
    ) -> None:
        release = None  # what the put calls once it is done with `block`
        try:
            payload = self.stored_form(block, dtype, vault, kv_split, sink_tokens)
            if isinstance(payload, tuple) and self.sealer is None:  # sent from block memory
                release, on_done = on_done, None
            if self.sealer is not None:  # the sealed copy is sent: `block` is free after this
                payload = self._sealed(self.sealer, block_address(namespace, key, part), payload)
        except NonFiniteError:
            with self._lock:
                self._stats.skipped_nonfinite += 1
            return
        except Exception:
            log.exception("encoding or sealing a block failed; it is not stored")
            with self._lock:
                self._stats.encode_errors += 1
            return
        finally:
            with self._lock:
                self._pending_encode_bytes -= block.nbytes
            if on_done is not None:
                on_done()
        client.put(namespace, key, part, payload, release)
        with self._lock:
            self._stats.queued_blocks += 1
            self._stats.queued_raw_bytes += block.nbytes
            self._stats.queued_payload_bytes += payload_bytes(payload)

    def _sealed(self, sealer: Sealer, address: bytes, payload: PutPayload) -> PutPayload:
        sealed = sealed_payload(sealer, address, payload)
        with self._lock:
            self._stats.sealed_blocks += 1
        return sealed

    def _open_then(
        self,
        sealer: Sealer,
        namespace: bytes,
        keys: Sequence[bytes],
        consume: Consume,
        blocks: list[Block],
    ) -> set[int]:
        """`consume` of a sealed load: each payload opened for its address, back to back in
        pooled buffers (as payloads received into one buffer lie, which the consumers' batched
        paths use); the ones that do not open are counted and fail."""
        failed: set[int] = set()
        opened: list[Block] = []
        sized = [(block, max(0, len(block[2]) - OVERHEAD_BYTES)) for block in blocks]
        room = RECEIVE_BUFFERS.buffer_bytes
        for batch in batched_by_size(sized, operator.itemgetter(1), room):
            total = sum(size for _, size in batch)
            pooled = total <= room  # else memory of its own, not zero-filled
            buffer = (RECEIVE_BUFFERS.take() if pooled else np.empty(total, np.uint8)).data[:total]
            at = 0
            for (index, part, payload), size in batch:
                out = buffer[at : at + size]
                at += size
                try:
                    sealer.open_into(block_address(namespace, keys[index], part), payload, out)
                except SealError as exc:
                    log.warning(
                        "block %d part %d does not open (%s); recomputing it",
                        index,
                        part,
                        exc,
                    )
                    failed.add(index)
                    with self._lock:
                        self._stats.open_failures += 1
                    continue
                opened.append((index, part, out.toreadonly()))
        return failed | (consume(opened) if opened else set())


def peak_resident_bytes() -> int:
    """The process's peak resident memory (getrusage: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def sealed_payload(sealer: Sealer, address: bytes, payload: PutPayload) -> PutPayload:
    """`payload` (a codec's, or a lossless block's header and memory) sealed for `address`: its
    header in the clear (authenticated), its body encrypted."""
    if isinstance(payload, tuple):  # a lossless block's header and its memory
        head, body = payload
    elif is_pair(payload):  # a K/V pair's header; its keys' and values' payloads are the body
        _, keys, values = parse_pair(payload)
        split = len(payload) - len(keys) - len(values)
        head, body = payload[:split], memoryview(payload)[split:]
    else:
        body = parse_header(payload)[1]
        head = payload[: len(payload) - len(body)]
    return sealer.seal(address, bytes(head), memoryview(body))
