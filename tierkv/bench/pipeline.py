"""The bench pipeline: synthetic KV of a real model's shape through encode, Put, Lookup, Promote and
decode, timed per phase against numpy memcpy of the same bytes measured in the same run.

`run_bench` is what `tierkv bench` calls; it needs no engine and no GPU. Without a vault address
it embeds a vault in-process on a free loopback port and stops it at the end; with several (vaults
or redis:// URLs) blocks are spread over them as tierkv.toml would. With `workers` > 1 the stored
prefix is also promoted by that many concurrent worker processes (`concurrent_promote`), each
with its own connections, and their GB/s are reported per worker and in aggregate.

Every codec then runs sealed beside unsealed in the same run (tierkv/seal.py): the payloads are
sealed (timed on one thread, as AES-GCM of `cryptography` holds the GIL), put, promoted, opened
and decoded again, under the newest key of `[security] data_key_file`, or a key made for the run
when none is configured.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import resource
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from functools import partial
from multiprocessing.synchronize import Barrier

import numpy as np

from tierkv.backends import open_backend
from tierkv.backends.base import Backend, BackendStats
from tierkv.config import KV_VAULT, SSM_VAULT, ClientConfig, Endpoint, SecurityConfig
from tierkv.keys import chain_block_keys, namespace_fingerprint
from tierkv.model_shapes import DEFAULT_MODEL_SHAPE, MODEL_SHAPES, ModelShape
from tierkv.quant import Codec, decode_into, fidelity, get_codec
from tierkv.quant import warmup as warmup_codecs
from tierkv.reliability import PutPayload, payload_bytes
from tierkv.seal import KEY_BYTES, Sealer, block_address
from tierkv.tier import ColdTier, sealed_payload
from tierkv.transfer import Into
from tierkv.vault.server import serve as serve_vault

LINK_GBITS = (1, 10, 25)
DECODE_THREADS = 2
"""Blocks decoded at once, as ColdTier's default decode pool does."""
WARMUP_RUNS = 1
"""Untimed runs of each codec before the timed ones (connections, caches, first page faults)."""
DEFAULT_REPEAT = 3
"""Timed runs of each codec; every phase reports their median."""
CLEANUP_FLUSH_S = 30.0
"""How long a bench that stops waits for its puts in flight before removing its blocks."""


class LinkView:
    """The bench's backend as one of its ColdTiers sees it: each Promote returns no sooner than its
    payload bytes would take to cross a link of `gbits` Gbit/s (None: as soon as the vault
    answers), so `ColdTier.load` over it is a restore over that link, its runs decoding while the
    next one is on the wire. The CPU the receiving side spends on the wire is not added (on
    loopback it is already in the time the vault took). `close` leaves the backend open: the
    bench's tiers share it, and the bench closes it once."""

    def __init__(self, backend: Backend, gbits: float | None = None) -> None:
        self.backend = backend
        self.gbits = gbits
        self.address = backend.address

    def put(
        self,
        namespace: bytes,
        key: bytes,
        part: int,
        payload: PutPayload,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.backend.put(namespace, key, part, payload, release)

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        return self.backend.lookup(namespace, keys, parts)

    def promote(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts: Sequence[int],
        into: Into | None = None,
    ) -> dict[tuple[int, int], memoryview]:
        start = time.perf_counter()
        found = self.backend.promote(namespace, keys, parts, into)
        if self.gbits is not None:
            wire_s = sum(map(len, found.values())) * 8 / (self.gbits * 1e9)
            time.sleep(max(0.0, wire_s - (time.perf_counter() - start)))
        return found

    def flush(self, timeout: float | None = None) -> bool:
        return self.backend.flush(timeout)

    def server_stats(self) -> list[BackendStats]:
        return self.backend.server_stats()

    def clear(self, namespace: bytes) -> int:
        return self.backend.clear(namespace)

    def counters(self) -> dict[str, int | str]:
        return self.backend.counters()

    def close(self) -> None:
        """Nothing: the backend is the bench's to close."""


@contextmanager
def bench_tier(
    codec: Codec, backend: Backend, gbits: float | None = None, sealer: Sealer | None = None
) -> Iterator[ColdTier]:
    """A ColdTier of `codec` whose "kv" and "ssm" vaults are `backend` (over a link of `gbits`,
    see LinkView), sealing with `sealer`; its threads end with the block, the backend stays."""
    link = LinkView(backend, gbits)
    tier = ColdTier(codec, {KV_VAULT: link, SSM_VAULT: link}, sealer=sealer)
    try:
        yield tier
    finally:
        tier.close()


@dataclass
class BenchResult:
    """One codec's figures; the JSON output is `as_json` of this. Each *_s field is the median
    over `runs` timed runs (after `warmup_runs` untimed ones), each *_gbps one the bytes of that
    phase over that median; a field that was not measured is None (absent from the JSON)."""

    tokens: int
    """The prompt length asked for."""
    tokens_measured: int
    """The tokens measured: whole blocks of `block_tokens` only."""
    model_shape: str
    codec: str
    vault: str
    """The vaults' addresses; embedded ones are gone when run_bench returns."""
    dtype: str
    block_tokens: int
    blocks: int
    raw_bytes: int
    stored_bytes: int
    ratio: float
    memcpy_gbps: float
    encode_s: float
    encode_gbps: float
    store_s: float
    store_gbps: float
    lookup_s: float
    hit_blocks: int
    promote_s: float
    promote_gbps: float
    decode_s: float
    decode_gbps: float
    """promote_s and decode_s: a bare Promote of every block and their decode on DECODE_THREADS,
    one after the other (the references the restore's pipeline is held against)."""
    load_s: float
    """ColdTier.load of every block: Promote runs, each decoded while the next is on the wire."""
    restore_s: float
    """ColdTier's lookup and load, as an engine restores: lookup_s + load_s of each run, their
    median."""
    restore_vs_memcpy: float
    snr_db: float
    cosine: float
    max_abs_err: float
    link_s: dict[str, float]
    """Wire time of the stored bytes per link speed."""
    link_restore_s: dict[str, float]
    """A restore over each link speed: lookup_s, then ColdTier.load with every Promote held
    back to the link's rate (see LinkView), the median of the runs."""
    peak_rss_bytes: int
    sealed_with: str
    """The data key the sealed run used: "data_key_file key N" or "a key made for the run"."""
    seal_s: float
    seal_gbps: float
    """Payload bytes sealed per second, on one thread."""
    sealed_store_s: float
    sealed_store_gbps: float
    sealed_promote_s: float
    sealed_promote_gbps: float
    open_s: float
    open_gbps: float
    """Payload bytes opened per second, on one thread."""
    sealed_decode_s: float
    sealed_load_s: float
    """ColdTier.load of the sealed blocks by a tier with the data key: it opens each run's
    payloads, then decodes them."""
    sealed_restore_s: float
    """lookup_s + sealed_load_s of each run, their median."""
    sealed_vs_unsealed_restore: float
    """restore_s ÷ sealed_restore_s (1.0: sealing costs nothing)."""
    runs: int = 1
    warmup_runs: int = WARMUP_RUNS
    spread_s: dict[str, list[float]] | None = None
    """[min, max] over the timed runs of each *_s field (restore_s and sealed_restore_s: of
    each run's own sum); None with a single timed run."""
    workers: int = 1
    worker_promote_gbps: list[float] | None = None
    """Each concurrent worker's promote of the whole prefix (workers > 1 only)."""
    aggregate_promote_gbps: float | None = None
    """Bytes all workers promoted ÷ the time from the first start to the last finish (workers > 1
    only)."""
    stored_bytes_per_token: float | None = None
    """stored_bytes ÷ tokens_measured: what the vaults hold per token a restore brings back."""
    full_attention_bytes_per_token: float | None = None
    """Sliding-window shapes: the same per token were every layer full attention, from the
    stored bytes of this run's blocks before the window (full-attention layers only) per token
    and layer, times every attention layer; None without such blocks or window layers."""

    def as_json(self) -> dict[str, object]:
        """The fields as JSON values: one not measured (None) is left out, a non-finite figure
        (the SNR of a lossless codec) is null."""
        return {
            name: None if isinstance(value, float) and not math.isfinite(value) else value
            for name, value in asdict(self).items()
            if value is not None
        }


@dataclass
class SyntheticKV:
    """The reference arrays, cut the way the vLLM connector stores them."""

    blocks: list[np.ndarray]
    """blocks[b]: every attention layer's K and V for block b, one payload,
    (layers, 2, block_tokens, kv_heads, head_dim): the full-attention layers, plus the
    sliding-window layers in the blocks inside the window before the prompt's end (the only
    ones of theirs a restore needs; the connector stores them as payloads of their own groups,
    the same bytes)."""
    states: list[np.ndarray]
    """One array per linear-attention layer: the state after the whole prompt."""
    dtype: str

    @property
    def raw_bytes(self) -> int:
        kv = sum(block.nbytes for block in self.blocks)
        return kv + sum(state.nbytes for state in self.states)


def synthetic_kv(
    shape: ModelShape, tokens: int, block_tokens: int, dtype: str, seed: int = 0
) -> SyntheticKV:
    """KV that looks like KV: per-channel scales with a few 10–20× outlier channels, per-token
    scales that vary and drift (bounded) along the sequence, per-layer variation. Full blocks
    only (`dtype` fp16 or fp32)."""
    np_dtype = np.float16 if dtype == "fp16" else np.float32
    rng = np.random.default_rng(seed)
    n_blocks = tokens // block_tokens
    used = n_blocks * block_tokens
    windowed = n_blocks - shape.window_blocks(n_blocks, block_tokens)  # first block with them
    full, layers = shape.attention_layers, shape.attention_layers + shape.window_layers
    head = (shape.kv_heads, shape.head_dim)
    blocks = [
        np.empty((layers if b >= windowed else full, 2, block_tokens, *head), np_dtype)
        for b in range(n_blocks)
    ]
    for index in range(layers):
        first = 0 if index < full else windowed  # a window layer: only its window's blocks
        span = used - first * block_tokens
        channel_scale = rng.lognormal(0.0, 0.3, size=(2, 1, shape.kv_heads, shape.head_dim))
        outliers = rng.choice(shape.head_dim, size=max(1, shape.head_dim // 32), replace=False)
        channel_scale[..., outliers] *= rng.uniform(10, 20, size=outliers.size)
        drift = 0.5 * np.sin(np.linspace(0, rng.uniform(2, 8) * np.pi, span))
        token_scale = np.exp(drift + rng.normal(0, 0.25, size=span))[None, :, None, None]
        layer = rng.standard_normal((2, span, shape.kv_heads, shape.head_dim), dtype=np.float32)
        # In place and in float32: the product of the two scales as one float64 array the size
        # of the layer cost more than drawing the layer.
        layer *= channel_scale.astype(np.float32)
        layer *= token_scale.astype(np.float32)
        for b in range(first, n_blocks):
            offset = (b - first) * block_tokens
            blocks[b][index] = layer[:, offset : offset + block_tokens]
    states = [
        (rng.standard_normal(shape.state_elements, dtype=np.float32) * 0.5).astype(np_dtype)
        for _ in range(shape.state_layers)
    ]
    return SyntheticKV(blocks, states, dtype)


def raw_kv_bytes(shape: ModelShape, tokens: int, block_tokens: int, dtype: str) -> int:
    """Bytes of the KV and state `synthetic_kv` makes: full blocks only."""
    itemsize = 2 if dtype == "fp16" else 4
    n_blocks = tokens // block_tokens
    window_tokens = shape.window_blocks(n_blocks, block_tokens) * block_tokens
    window_kv = shape.window_layers * 2 * shape.kv_heads * shape.head_dim * itemsize
    return (
        n_blocks * block_tokens * shape.kv_bytes_per_token(itemsize)
        + window_tokens * window_kv
        + shape.state_layers * shape.state_elements * itemsize
    )


def bench_memory_bytes(shape: ModelShape, tokens: int, block_tokens: int, dtype: str) -> int:
    """About what a run holds at its peak (the sealed pass: docs/figures.md, "Bench memory"):
    six copies of the KV (the reference, the vault's sealed copy, its promoted payloads, the
    opened ones, their decode, a sealed ColdTier.load's), one layer in float32 while
    generating, plus the process itself."""
    used = tokens // block_tokens * block_tokens
    layer_f32 = 2 * used * shape.kv_heads * shape.head_dim * 4
    return 6 * raw_kv_bytes(shape, tokens, block_tokens, dtype) + layer_f32 + 600_000_000


def available_memory_bytes() -> int:
    """Memory available to a new allocation: /proc/meminfo's MemAvailable, else physical RAM."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """numpy copy throughput of `nbytes` (best of `repeats`), the reference for every phase."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextmanager
def vault_addresses(addresses: Sequence[str]) -> Iterator[list[str]]:
    """`addresses` as given, or an embedded in-process vault on a free loopback port."""
    if addresses:
        yield list(addresses)
        return
    server = serve_vault("127.0.0.1:0", max_bytes=0)
    try:
        yield [server.address]
    finally:
        server.stop()


def bench_client_config(max_pending_bytes: int) -> ClientConfig:
    """Deadlines for bulk transfers of a benchmark, and a put queue that holds every payload."""
    return ClientConfig(
        deadline_ms=30_000, promote_deadline_ms=300_000, max_pending_bytes=max_pending_bytes
    )


def concurrent_promote(
    addresses: Sequence[str],
    client_cfg: ClientConfig,
    namespace: bytes,
    keys: Sequence[bytes],
    parts: Sequence[int],
    workers: int,
    security: SecurityConfig | None = None,
) -> tuple[list[float], float]:
    """(each worker's GB/s, aggregate GB/s) of `workers` processes promoting the same blocks at
    once, each through its own backend (token and TLS of `security`); they start together at a
    barrier. Raises RuntimeError when a worker got fewer blocks than asked for."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(workers)
    results = context.Queue()
    args = (
        list(addresses),
        client_cfg,
        security,
        namespace,
        list(keys),
        list(parts),
        barrier,
        results,
    )
    processes = [context.Process(target=_promote_worker, args=args) for _ in range(workers)]
    for process in processes:
        process.start()
    runs = [results.get(timeout=client_cfg.promote_deadline_ms / 1000 + 120) for _ in processes]
    for process in processes:
        process.join()
    if any(isinstance(run, str) for run in runs):
        raise RuntimeError(f"a promote worker failed: {[r for r in runs if isinstance(r, str)]}")
    total = sum(nbytes for nbytes, _, _ in runs)
    span = max(end for _, _, end in runs) - min(start for _, start, _ in runs)
    return [nbytes / (end - start) / 1e9 for nbytes, start, end in runs], total / span / 1e9


def _promote_worker(
    addresses: list[str],
    client_cfg: ClientConfig,
    security: SecurityConfig | None,
    namespace: bytes,
    keys: list[bytes],
    parts: list[int],
    barrier: Barrier,
    results: multiprocessing.Queue,
) -> None:
    """One worker of concurrent_promote: (bytes, start, end) or an error message on `results`."""
    backend = open_backend([Endpoint(address) for address in addresses], client_cfg, security)
    try:
        backend.promote(namespace, keys[:1], parts)  # connect (both paths) before the clock
        barrier.wait()
        start = time.monotonic()  # system-wide clock: comparable across the workers
        found = backend.promote(namespace, keys, parts)
        end = time.monotonic()
        if len(found) != len(keys) * len(parts):
            results.put(f"got {len(found)} of {len(keys) * len(parts)} blocks")
        else:
            results.put((sum(len(p) for p in found.values()), start, end))
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")
    finally:
        backend.close()


def run_bench(
    *,
    tokens: int,
    model_shape: str = DEFAULT_MODEL_SHAPE,
    codecs: list[str],
    dtype: str = "fp16",
    block_tokens: int = 256,
    vaults: Sequence[str] = (),
    security: SecurityConfig | None = None,
    workers: int = 1,
    repeat: int = DEFAULT_REPEAT,
    links: bool = False,
    on_phase: Callable[[str, str, int, int], None] = lambda codec, phase, done, total: None,
) -> list[BenchResult]:
    """Run every phase for each codec, WARMUP_RUNS times untimed, then `repeat` times timed,
    with `links` each timed run's restore over every LINK_GBITS link too (they take the wire's
    time: most of a large bench's);
    `on_phase(codec, phase, done, total)` reports progress ("compile" first, with what is being
    compiled in place of the codec). `vaults` are reached with the token and TLS of `security`
    (the embedded vault, when none is given, without). Every block the bench stores is removed
    again however it ends (an error, a full vault, KeyboardInterrupt): none stays in a vault.

    ValueError: bad arguments, or more memory needed than this machine has available (checked
    before anything is generated). BackendUnavailable: a vault does not answer (checked first too).
    RuntimeError: a vault lost or refused blocks (full?).
    """
    try:
        shape = MODEL_SHAPES[model_shape]
    except KeyError:
        raise ValueError(
            f"--model-shape {model_shape!r} is unknown; use one of {', '.join(MODEL_SHAPES)}"
        ) from None
    if dtype not in ("fp16", "fp32"):
        raise ValueError(f"--dtype {dtype!r} is unknown; use fp16 or fp32")
    if repeat < 1:
        raise ValueError(f"--repeat {repeat}: expected at least 1 timed run")
    if tokens < block_tokens:
        raise ValueError(f"--tokens {tokens} is less than one block of {block_tokens} tokens")
    needed = bench_memory_bytes(shape, tokens, block_tokens, dtype)
    available = available_memory_bytes()
    if needed > available:
        raise ValueError(
            f"--tokens {tokens} needs about {needed / 1e9:,.1f} GB of memory, "
            f"{available / 1e9:,.1f} GB is available"
        )
    coded = [get_codec(name, group_size=shape.head_dim) for name in codecs]
    results = []
    sealer = bench_sealer(security)
    security = security if vaults else None
    with vault_addresses(vaults) as addresses:
        # Every payload is already in memory: let the put queue hold them all, so none is dropped.
        client_cfg = bench_client_config(2 * raw_kv_bytes(shape, tokens, block_tokens, dtype))
        endpoints = [Endpoint(address) for address in addresses]
        backend = open_backend(endpoints, client_cfg, security)
        try:
            backend.server_stats()  # BackendUnavailable now rather than after generating the data
            warmup_codecs(
                [*codecs, "none"],
                [dtype],
                on_step=lambda what, done, total: on_phase(what, "compile", done, total),
            )
            on_phase(codecs[0], "generate", 0, 1)
            kv = synthetic_kv(shape, tokens, block_tokens, dtype)
            on_phase(codecs[0], "generate", 1, 1)
            reference_gbps = memcpy_gbps(kv.raw_bytes)
            room = _Room(kv)
            with removed_afterwards(backend) as held:
                for codec in coded:
                    results.append(
                        _bench_codec(
                            backend,
                            codec,
                            (kv, room),
                            (model_shape, shape),
                            tokens,
                            reference_gbps,
                            held,
                            sealer,
                            repeat,
                            links,
                            partial(on_phase, codec.name),
                            promote_workers=(addresses, client_cfg, security, workers),
                        )
                    )
        finally:
            backend.close()
    return results


@contextmanager
def removed_afterwards(client: Backend) -> Iterator[list[bytes]]:
    """A list to add each namespace to before storing under it; however the block ends (an
    exception, KeyboardInterrupt), the puts still in flight are waited for (CLEANUP_FLUSH_S at
    most) and every namespace left in the list is cleared. A failure to clear is raised only when
    nothing else was."""
    held: list[bytes] = []
    try:
        yield held
    except BaseException:
        with suppress(Exception):
            _clear(client, held, *held)
        raise
    _clear(client, held, *held)


def _new_namespaces(held: list[bytes], codec: str, *kinds: str) -> list[bytes]:
    """A namespace of this run for each of `kinds`, added to `held` (to be cleared)."""
    run_id = uuid.uuid4().hex
    namespaces = [
        namespace_fingerprint({"bench": run_id, "codec": codec, "kind": kind}) for kind in kinds
    ]
    held.extend(namespaces)
    return namespaces


def _clear(client: Backend, held: list[bytes], *namespaces: bytes) -> None:
    """Remove every block of `namespaces` from the vaults (once their puts are answered), and
    the namespaces from `held`."""
    client.flush(timeout=CLEANUP_FLUSH_S)
    for namespace in namespaces:
        client.clear(namespace)
        held.remove(namespace)


def bench_sealer(security: SecurityConfig | None) -> tuple[Sealer, str]:
    """(the sealer of the sealed run, which key it seals with): the configured data keys', else
    one of a key made for the run (ConfigError: the configured file holds no valid keys)."""
    if security is not None and security.data_key_file:
        sealer = Sealer.from_file(security.data_key_file)
        return sealer, f"data_key_file key {sealer.key_id}"
    return Sealer({1: os.urandom(KEY_BYTES)}, 1), "a key made for the run"


Report = Callable[[str, int, int], None]
"""on_phase of one codec: (phase, done, total)."""
RESTORE_PHASES = ("lookup_s", "load_s")
SEALED_RESTORE_PHASES = ("lookup_s", "sealed_load_s")


@dataclass
class _Run:
    """One pass of a codec through every phase, unsealed and sealed."""

    seconds: dict[str, float] = field(default_factory=dict)
    """Each *_s field of BenchResult that the pass timed."""
    moved: dict[str, int] = field(default_factory=dict)
    """The bytes each of those phases handled (for its GB/s)."""
    links: dict[str, float] = field(default_factory=dict)
    """A restore over each link speed (see BenchResult.link_restore_s)."""
    full_only: tuple[int, int] = (0, 0)
    """Stored bytes and tokens of the blocks before the window (full-attention layers only)."""


def _bench_codec(
    client: Backend,
    codec: Codec,
    data: tuple[SyntheticKV, _Room],
    model: tuple[str, ModelShape],
    tokens: int,
    reference_gbps: float,
    held: list[bytes],
    sealer: tuple[Sealer, str],
    repeat: int,
    links: bool,
    report: Report,
    promote_workers: tuple[list[str], ClientConfig, SecurityConfig | None, int],
) -> BenchResult:
    """One codec through every phase, WARMUP_RUNS + `repeat` times; the median of the timed
    runs, their spread, and the fidelity of the last. Blocks are stored and restored as an
    engine's are, by a ColdTier of `codec` over `client`: attention blocks through the codec,
    linear-attention state (which an engine keeps feeding forward) lossless. The codec is
    timed against `reference_gbps`, memcpy of the same bytes. `data`: the KV, and the memory
    its restores write into."""
    kv, room = data
    model_shape, shape = model
    n_blocks = len(kv.blocks)
    block_tokens = kv.blocks[0].shape[2]
    keys = chain_block_keys(np.arange(n_blocks * block_tokens) % 50_000, block_tokens)
    addresses, client_cfg, security, workers = promote_workers
    worker_gbps: list[float] | None = None
    aggregate_gbps: float | None = None
    timed: list[_Run] = []
    for index in range(WARMUP_RUNS + repeat):
        run = _Run()
        kv_ns, state_ns = _new_namespaces(held, codec.name, "kv", "state")
        timing = index >= WARMUP_RUNS
        namespaces = (kv_ns, state_ns)
        over_links = timing and links
        restored = _unsealed_pass(
            client, codec, (kv, room), shape, keys, namespaces, run, report, over_links
        )
        if index == WARMUP_RUNS + repeat - 1:  # the fidelity of the last run (the sealed pass
            # writes the same memory next)
            worst = [fidelity(ref, out) for ref, out in zip(kv.blocks, restored, strict=True)]
        del restored
        if workers > 1 and index == WARMUP_RUNS + repeat - 1:
            report("promote ×workers", 0, 1)
            worker_gbps, aggregate_gbps = concurrent_promote(
                addresses, client_cfg, kv_ns, keys, [0], workers, security
            )
            report("promote ×workers", 1, 1)
        _clear(client, held, kv_ns, state_ns)
        sealed_ns = _new_namespaces(held, codec.name, "sealed kv", "sealed st")
        _sealed_pass(client, codec, (kv, room), shape, keys, sealed_ns, sealer[0], run, report)
        _clear(client, held, *sealed_ns)
        if timing:
            timed.append(run)

    for r in timed:
        for total, phases in (
            ("restore_s", RESTORE_PHASES),
            ("sealed_restore_s", SEALED_RESTORE_PHASES),
        ):
            r.seconds[total] = sum(r.seconds[phase] for phase in phases)
    median = {name: statistics.median(r.seconds[name] for r in timed) for name in run.seconds}
    spread: dict[str, list[float]] | None = None
    if len(timed) > 1:
        per_run = {name: [r.seconds[name] for r in timed] for name in median}
        spread = {name: [min(values), max(values)] for name, values in per_run.items()}

    def gbps(phase: str) -> float:
        return run.moved[phase] / median[phase] / 1e9

    raw = kv.raw_bytes
    stored_bytes = run.moved["store_s"]
    full_bytes, full_tokens = run.full_only
    full_per_token = None
    if shape.window_layers and full_tokens:
        layers = shape.attention_layers + shape.window_layers
        full_per_token = full_bytes / full_tokens / shape.attention_layers * layers
    return BenchResult(
        tokens=tokens,
        tokens_measured=n_blocks * block_tokens,
        model_shape=model_shape,
        codec=codec.name,
        vault=client.address,
        dtype=kv.dtype,
        block_tokens=block_tokens,
        blocks=n_blocks,
        raw_bytes=raw,
        stored_bytes=stored_bytes,
        ratio=raw / stored_bytes,
        memcpy_gbps=reference_gbps,
        encode_s=median["encode_s"],
        encode_gbps=gbps("encode_s"),
        store_s=median["store_s"],
        store_gbps=gbps("store_s"),
        lookup_s=median["lookup_s"],
        hit_blocks=n_blocks,
        stored_bytes_per_token=stored_bytes / (n_blocks * block_tokens),
        full_attention_bytes_per_token=full_per_token,
        promote_s=median["promote_s"],
        promote_gbps=gbps("promote_s"),
        decode_s=median["decode_s"],
        decode_gbps=gbps("decode_s"),
        load_s=median["load_s"],
        restore_s=median["restore_s"],
        restore_vs_memcpy=(raw / reference_gbps / 1e9) / median["restore_s"],
        snr_db=min(f.snr_db for f in worst),
        cosine=min(f.cosine for f in worst),
        max_abs_err=max(f.max_abs_err for f in worst),
        link_s={f"{g}GbE": stored_bytes * 8 / (g * 1e9) for g in LINK_GBITS},
        link_restore_s={
            link: statistics.median(r.links[link] for r in timed) for link in run.links
        },
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        sealed_with=sealer[1],
        seal_s=median["seal_s"],
        seal_gbps=gbps("seal_s"),
        sealed_store_s=median["sealed_store_s"],
        sealed_store_gbps=gbps("sealed_store_s"),
        sealed_promote_s=median["sealed_promote_s"],
        sealed_promote_gbps=gbps("sealed_promote_s"),
        open_s=median["open_s"],
        open_gbps=gbps("open_s"),
        sealed_decode_s=median["sealed_decode_s"],
        sealed_load_s=median["sealed_load_s"],
        sealed_restore_s=median["sealed_restore_s"],
        sealed_vs_unsealed_restore=median["restore_s"] / median["sealed_restore_s"],
        runs=repeat,
        spread_s=spread,
        workers=workers,
        worker_promote_gbps=worker_gbps,
        aggregate_promote_gbps=aggregate_gbps,
    )


def _put_all(
    client: Backend,
    payloads: dict[tuple[bytes, bytes, int], PutPayload],
    report: Report,
    phase: str,
) -> float:
    """Put every payload and wait for the vault's answers: the seconds it took."""
    start = time.perf_counter()
    for i, ((namespace, key, part), payload) in enumerate(payloads.items()):
        client.put(namespace, key, part, payload)
        if i % 64 == 0:
            report(phase, i + 1, len(payloads))
    if not client.flush(timeout=600):
        raise RuntimeError(f"the vault at {client.address} did not acknowledge every block")
    seconds = time.perf_counter() - start
    report(phase, len(payloads), len(payloads))
    return seconds


def _stored_forms(
    tier: ColdTier, kv: SyntheticKV, keys: list[bytes], namespaces: Sequence[bytes]
) -> dict[tuple[bytes, bytes, int], PutPayload]:
    """What `tier.store` would send of the KV under `namespaces` (kv, state): each block under
    its key (encoded on the tier's encode threads, as store encodes), each state layer as a part
    of the last key."""
    kv_ns, state_ns = namespaces
    blocks = tier.stored_forms(kv.blocks, kv_split=(1, 1))  # (layers, K|V, ...): a pair splits
    forms = {(kv_ns, keys[b], 0): form for b, form in enumerate(blocks)}
    for part, state in enumerate(kv.states):
        forms[(state_ns, keys[-1], part)] = tier.stored_form(state, vault=SSM_VAULT)
    return forms


def _loaded(
    tier: ColdTier,
    keys: list[bytes],
    namespaces: Sequence[bytes],
    restored: list[np.ndarray],
    restored_states: list[np.ndarray],
) -> float:
    """`tier.load` of every block into `restored` and of the state into `restored_states`: the
    seconds it took. RuntimeError when a block or a state layer did not restore."""
    kv_ns, state_ns = namespaces
    state_parts = list(range(len(restored_states)))
    start = time.perf_counter()
    failed = tier.load(kv_ns, keys, {KV_VAULT: [0]}, lambda index, part: restored[index])
    if state_parts and tier.load(
        state_ns, keys[-1:], {SSM_VAULT: state_parts}, lambda index, part: restored_states[part]
    ):
        failed.add(len(keys) - 1)
    seconds = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"ColdTier.load restored {len(keys) - len(failed)} of {len(keys)}")
    return seconds


def _touched(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Zeroed arrays like `arrays`, their pages touched."""
    out = [np.empty_like(array) for array in arrays]
    for array in out:
        array.fill(0)  # (np.zeros would leave the pages untouched)
    return out


class _Room:
    """The memory every restore of a bench writes into, made and touched once: an engine decodes
    into its resident KV cache and opens into its pooled receive buffers, so no decode, open or
    load is charged with first-touch page faults (the same for every codec and run; touching
    fresh memory for each took a quarter of a bench's time). Zeroed again before each use, so
    a pass that left a block unwritten cannot pass its checks with an earlier pass's bytes."""

    def __init__(self, kv: SyntheticKV) -> None:
        self._blocks, self._states = _touched(kv.blocks), _touched(kv.states)
        self._bytes = np.empty(0, dtype=np.uint8)

    def outputs(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Arrays like the KV's blocks and states, zeroed."""
        for array in (*self._blocks, *self._states):
            array.fill(0)
        return self._blocks, self._states

    def bytes(self, size: int) -> np.ndarray:
        """`size` bytes, touched (grown when a codec needs more than an earlier one)."""
        if self._bytes.size < size:
            self._bytes = np.empty(0, dtype=np.uint8)  # the old one let go first
            self._bytes = _touched([np.empty(size, dtype=np.uint8)])[0]
        return self._bytes[:size]


def _unsealed_pass(
    client: Backend,
    codec: Codec,
    data: tuple[SyntheticKV, _Room],
    shape: ModelShape,
    keys: list[bytes],
    namespaces: Sequence[bytes],
    run: _Run,
    report: Report,
    over_links: bool,
) -> list[np.ndarray]:
    """Encode, put, lookup, promote and decode the KV under `namespaces` (kv, state), then load
    it as ColdTier does, and over each link speed too when `over_links` (the warm-up runs
    skip them: they take the wire's time), timed into `run`; the blocks the last load restored.
    RuntimeError when a block is missing or state is not bit-exact. `data`: the KV, and the
    memory the restores write into (the blocks returned are in it)."""
    kv, room = data
    kv_ns, state_ns = namespaces
    n_blocks = len(kv.blocks)
    state_parts = list(range(shape.state_layers))
    raw = kv.raw_bytes
    with bench_tier(codec, client) as tier:
        start = time.perf_counter()
        payloads = _stored_forms(tier, kv, keys, namespaces)
        run.seconds["encode_s"], run.moved["encode_s"] = time.perf_counter() - start, raw
        report("encode", n_blocks, n_blocks)
        run.moved["store_s"] = sum(payload_bytes(p) for p in payloads.values())
        block_tokens = kv.blocks[0].shape[2]
        before_window = n_blocks - shape.window_blocks(n_blocks, block_tokens)
        run.full_only = (
            sum(payload_bytes(payloads[kv_ns, keys[b], 0]) for b in range(before_window)),
            before_window * block_tokens,
        )
        run.seconds["store_s"] = _put_all(client, payloads, report, "put")
        del payloads

        start = time.perf_counter()
        hit = tier.lookup(kv_ns, keys, {KV_VAULT: [0]})
        if state_parts:
            whole = tier.lookup(state_ns, keys[-1:], {SSM_VAULT: state_parts})
            hit = min(hit, n_blocks if whole else 0)
        run.seconds["lookup_s"] = time.perf_counter() - start
        report("lookup", 1, 1)
        if hit != n_blocks:
            raise RuntimeError(
                f"the vault holds {hit} of {n_blocks} blocks just stored (is it full?)"
            )

        # The references: a bare Promote of everything, then its decode.
        start = time.perf_counter()
        fetched = client.promote(kv_ns, keys, [0])
        fetched_states = client.promote(state_ns, keys[-1:], state_parts) if state_parts else {}
        run.seconds["promote_s"] = time.perf_counter() - start
        report("promote", 1, 1)
        run.moved["promote_s"] = sum(len(p) for p in fetched.values()) + sum(
            len(p) for p in fetched_states.values()
        )
        if len(fetched) != n_blocks or len(fetched_states) != len(state_parts):
            raise RuntimeError("the vault returned fewer blocks than it holds")
        restored, restored_states = room.outputs()
        start = time.perf_counter()
        with ThreadPoolExecutor(DECODE_THREADS) as pool:
            blocks = [fetched[(b, 0)] for b in range(n_blocks)]
            for b, _ in enumerate(pool.map(decode_into, blocks, restored)):
                report("decode", b + 1, n_blocks)
            states = [fetched_states[(0, part)] for part in state_parts]
            list(pool.map(decode_into, states, restored_states))
        run.seconds["decode_s"], run.moved["decode_s"] = time.perf_counter() - start, raw
        del fetched, fetched_states, blocks, states

        report("load", 0, 1)
        run.seconds["load_s"] = _loaded(tier, keys, namespaces, restored, restored_states)
        report("load", 1, 1)
    if not all(map(np.array_equal, kv.states, restored_states)):
        raise RuntimeError("linear-attention state did not round-trip bit-exact")
    if over_links:
        for done, gbits in enumerate(LINK_GBITS):
            report("link loads", done, len(LINK_GBITS))
            with bench_tier(codec, client, gbits) as linked:
                seconds = _loaded(linked, keys, namespaces, restored, restored_states)
            run.links[f"{gbits}GbE"] = run.seconds["lookup_s"] + seconds
        report("link loads", len(LINK_GBITS), len(LINK_GBITS))
    return restored


def _sealed_pass(
    client: Backend,
    codec: Codec,
    data: tuple[SyntheticKV, _Room],
    shape: ModelShape,
    keys: list[bytes],
    namespaces: Sequence[bytes],
    sealer: Sealer,
    run: _Run,
    report: Report,
) -> None:
    """The codec's blocks again, sealed, under `namespaces` (kv, state): seal, put, lookup-free
    promote, open, decode, then a sealed ColdTier's load, timed into `run` (the lookup is the
    unsealed pass's). RuntimeError when a sealed block is lost or does not restore bit for bit
    as the unsealed pass did. `data`: the KV, and the memory the restores write into."""
    kv, room = data
    kv_ns, state_ns = namespaces
    n_blocks = len(kv.blocks)
    state_parts = list(range(shape.state_layers))
    with bench_tier(codec, client, sealer=sealer) as tier:
        forms = _stored_forms(tier, kv, keys, namespaces)
        report("seal", 0, 1)
        start = time.perf_counter()
        sealed = {
            (ns, key, part): sealed_payload(sealer, block_address(ns, key, part), form)
            for (ns, key, part), form in forms.items()
        }
        run.seconds["seal_s"] = time.perf_counter() - start
        run.moved["seal_s"] = sum(map(payload_bytes, forms.values()))
        del forms
        sealed_bytes = sum(map(payload_bytes, sealed.values()))
        run.seconds["sealed_store_s"] = _put_all(client, sealed, report, "sealed put")
        run.moved["sealed_store_s"] = run.moved["sealed_promote_s"] = sealed_bytes
        del sealed

        # The references: a bare Promote, opening every payload, decoding them.
        report("sealed promote", 0, 1)
        start = time.perf_counter()
        fetched = client.promote(kv_ns, keys, [0])
        fetched_states = client.promote(state_ns, keys[-1:], state_parts) if state_parts else {}
        run.seconds["sealed_promote_s"] = time.perf_counter() - start
        if len(fetched) != n_blocks or len(fetched_states) != len(state_parts):
            raise RuntimeError("the vault returned fewer sealed blocks than it holds")
        report("open", 0, 1)
        arrived = [(kv_ns, keys[b], 0, fetched[(b, 0)]) for b in range(n_blocks)]
        arrived += [(state_ns, keys[-1], part, fetched_states[(0, part)]) for part in state_parts]
        # Opened into memory already touched, as the tier opens into its pooled receive buffers.
        sizes = [sealer.opened_bytes(payload) for *_, payload in arrived]
        into = room.bytes(sum(sizes))
        ends = np.cumsum(sizes).tolist()
        opened = [into.data[end - size : end] for size, end in zip(sizes, ends, strict=True)]
        start = time.perf_counter()
        for (namespace, key, part, payload), out in zip(arrived, opened, strict=True):
            sealer.open_into(block_address(namespace, key, part), payload, out)
        run.seconds["open_s"] = time.perf_counter() - start
        run.moved["open_s"] = sum(map(len, opened))
        del fetched, fetched_states, arrived
        restored, restored_states = room.outputs()
        report("sealed decode", 0, 1)
        start = time.perf_counter()
        with ThreadPoolExecutor(DECODE_THREADS) as pool:
            list(pool.map(decode_into, opened, [*restored, *restored_states]))
        run.seconds["sealed_decode_s"] = time.perf_counter() - start
        del opened, into

        report("sealed load", 0, 1)
        restored, restored_states = room.outputs()
        run.seconds["sealed_load_s"] = _loaded(tier, keys, namespaces, restored, restored_states)
        report("sealed load", 1, 1)
    if codec.name == "none" and not all(map(np.array_equal, kv.blocks, restored)):
        raise RuntimeError("sealed lossless blocks did not round-trip bit-exact")
    if not all(map(np.array_equal, kv.states, restored_states)):
        raise RuntimeError("sealed linear-attention state did not round-trip bit-exact")
