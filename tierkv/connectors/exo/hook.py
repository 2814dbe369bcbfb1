"""Runtime hook in EXO's runners: spill evicted prompt caches to the cold tier, restore on a miss.

The boot module hands two EXO modules here as soon as they are imported:
- `exo.worker.runner.bootstrap`: `entrypoint(bound_instance, ...)` is wrapped to learn which model
  and which layers / heads this runner holds (`bound_instance.bound_shard`);
- `exo.worker.engines.mlx.cache`: `KVPrefixCache` gets three wrapped methods.
  `_evict_if_needed`: every entry it pops is handed to a background thread that copies its
  filled tokens block by block into the tier (ColdTier.store), never more than
  `connector.staging_bytes` of copies at a time, so an entry of any length reaches the vault;
  generation never waits for it.
  `get_kv_cache`: when the vault holds a longer block-aligned prefix of the prompt than EXO's
  local hit, the caches are rebuilt from it and only the remaining suffix is returned.
  `add_kv_cache`: with `[exo] write_through = true`, new entries are spilled at once too.

Blocks are keyed by the chained hash of `block_tokens`-token blocks; part = 2 x global layer
index (+1 for values); the namespace fingerprints model id, the weight files (where EXO's
`build_model_path` finds them; tierkv.keys.weights_fingerprint), head slice, dtype, geometry, block
size and FORMAT_VERSION.

Cache kinds: mlx-lm's plain `KVCache` and its `RotatingKVCache` (sliding-window layers: Gemma,
gpt-oss, ...; all rotating layers of a runner must share one window). A plain layer stores every
block of the prefix; a rotating layer only the blocks of its window before the restore point T (a
block boundary): the `keep` first tokens and the newest ones, `max_size` in all (`Window`). A
restored rotating layer holds those tokens oldest first, `offset` = T and `_idx` = their count:
the state mlx-lm's own cache has after a prefill of T tokens and trimmed to its window, which
attends to the same keys at every later step as the layer EXO had (its buffer may have been
rotated in another order; EXO's own snapshots of rotating layers are made the same way). The
namespace covers the window and which layers rotate, so nothing stored for one layout restores
into another. An entry with any other cache kind (quantized, recurrent state, ...), or rotating
layers of different windows, is left to EXO's normal path (reported once per kind).

Kernels: the runner's start compiles (or loads from Numba's cache) the configured codec and the
lossless one for bf16, MLX's usual KV dtype, single-threaded only, which is what blocks below
PARALLEL_MIN_BYTES use. The first prompt whose blocks need more (another dtype, or blocks large
enough for the multi-threaded builds) starts compiling those in the background; until they are
ready such prompts are not restored (EXO prefills them), and spills just wait for them.

Codecs: the blocks are encoded and decoded by the Numba kernels on the host, a choice the
runner's start logs once (`codec_engine`): tierkv.quant.mlx_ops encodes and decodes the same
payloads on MLX arrays, but with mlx[cpu] it measured many times slower than Numba
(benchmarks/bench_mlx.py), and on Metal it is untested, so nothing measured favours it yet.

In a distributed instance every rank takes part in agreeing (all_gather, minimum) on the number
of restored tokens, even when its own lookup failed or tierkv is not configured on it; so the
hook must be installed on all nodes of an instance or on none. Every error inside tierkv leaves
EXO's own result in place (fail-open); `TIERKV_DISABLE=1` turns the hook off.
"""

from __future__ import annotations

import atexit
import functools
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache

from tierkv.codecs import FRAMEWORK_DTYPES, SINK_TOKENS
from tierkv.config import KV_VAULT, TierKVConfig, load_config, resolve_auto_codec
from tierkv.connectors.exo.boot import BOOTSTRAP_MODULE, CACHE_MODULE, disabled
from tierkv.keys import chain_block_keys, namespace_fingerprint, weights_fingerprint
from tierkv.logs import get_logger
from tierkv.quant.kernels import PARALLEL_MIN_BYTES
from tierkv.quant.linerate import line_rate_note
from tierkv.tier import ColdTier

log = get_logger("tierkv.exo")

FORMAT_VERSION = 1
VAULT = KV_VAULT
_PATCHED = "__tierkv_patched__"
HOOKED_METHODS = ("__init__", "get_kv_cache", "add_kv_cache", "_evict_if_needed")
MAX_QUEUED_SPILLS = 8
"""Evicted entries waiting for the spill thread (each holds EXO's arrays until it is spilled)."""
SPILL_WAIT_S = 0.5
"""How often a spill waiting for staging space checks whether the runtime is closing."""
MAX_WINDOW_PROBES = 4
"""Lookups a restore makes at most to find a restore point whose rotating-layer window is held."""

# mlx dtype -> (codec dtype name, numpy dtype the host copy uses; bf16, which numpy lacks, travels
# as its bits)
_DTYPES: dict[Any, tuple[str, type[np.generic]]] = {
    getattr(mx, name): (ours, getattr(np, name, np.uint16))
    for name, ours in FRAMEWORK_DTYPES.items()
}


@dataclass(frozen=True)
class ShardContext:
    """The model and the slice of it this runner holds (from EXO's bound shard)."""

    model_id: str
    start_layer: int
    head_rank: int = 0
    head_ranks: int = 1
    weights: str | None = None
    """Fingerprint of the weight files; None where EXO's model directory was not found."""


@dataclass(frozen=True)
class Geometry:
    """Shape and dtype every plain KVCache layer of the model shares."""

    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: Any  # an mx.Dtype

    def block_bytes(self, block_tokens: int) -> int:
        """Bytes of the largest array one block of one layer is encoded from or decoded into."""
        itemsize = np.dtype(_DTYPES[self.dtype][1]).itemsize
        return self.kv_heads * block_tokens * max(self.key_dim, self.value_dim) * itemsize


@dataclass(frozen=True)
class Window:
    """What mlx-lm's RotatingKVCache layers keep: the `keep` first tokens of the sequence and the
    newest ones, `max_size` in all."""

    max_size: int
    keep: int

    def positions(self, tokens: int) -> np.ndarray:
        """The token positions a rotating layer holds after `tokens` tokens, oldest first."""
        held = min(tokens, self.max_size)
        keep = min(self.keep, held)
        return np.concatenate([np.arange(keep), np.arange(tokens - (held - keep), tokens)])

    def blocks(self, tokens: int, block_tokens: int) -> list[int]:
        """The blocks of `block_tokens` tokens those positions lie in, in order."""
        return [int(i) for i in np.unique(self.positions(tokens) // block_tokens)]


@dataclass(frozen=True)
class Layout:
    """Which layers of a cache (indices in this runner's slice) rotate, and their window."""

    window: Window | None = None
    rotating: tuple[int, ...] = ()

    def plain(self, layers: int) -> list[int]:
        return [i for i in range(layers) if i not in self.rotating]


PLAIN = Layout()
"""Every layer a plain KVCache."""


@dataclass(frozen=True)
class _Held:
    """Where the tokens a rotating layer holds sit in its buffer: positions [0, head) and
    [tail, offset), oldest first, in buffer slots `slots` (mlx-lm's `_temporal_order` rule)."""

    slots: np.ndarray
    head: int
    tail: int
    offset: int

    @classmethod
    def of(cls, layer: Any) -> _Held:
        size, idx, keep, offset = layer.keys.shape[2], layer._idx, layer.keep, layer.offset
        if idx == size:  # in order (after a prefill step)
            slots = np.arange(size)
        elif idx < offset:  # rotated by single-token steps: the oldest tokens start at idx
            slots = np.concatenate([np.arange(keep), np.arange(idx, size), np.arange(keep, idx)])
        else:  # not full yet: slots past idx are unused
            slots = np.arange(idx)
        head = min(keep, len(slots))
        tail = offset - (len(slots) - head)
        return cls(slots, 0, 0, offset) if tail <= head else cls(slots, head, tail, offset)

    def slots_of(self, start: int, stop: int) -> np.ndarray | None:
        """The slots of positions [start, stop), or None if the layer no longer holds them all."""
        if stop <= self.head:
            return self.slots[start:stop]
        if self.tail <= start and stop <= self.offset:
            return self.slots[self.head + start - self.tail : self.head + stop - self.tail]
        return None


@dataclass(frozen=True)
class _Spill:
    """An evicted (or written-through) entry waiting for the spill thread."""

    tokens: np.ndarray
    layers: list[tuple[mx.array, mx.array]]
    blocks: int
    """Blocks of the prefix spilled (the plain layers' blocks, and the rotating layers' window
    blocks before its end)."""
    geometry: Geometry
    layout: Layout
    held: dict[int, _Held]
    """Per rotating layer, where its tokens sit."""


@dataclass(frozen=True)
class _Plan:
    """What this rank found in the vault for one prompt."""

    tokens: int
    keys: list[bytes]
    namespace: bytes
    geometry: Geometry
    layers: int
    layout: Layout


_reported: set[str] = set()
_shard: ShardContext | None = None
_runtime: ExoRuntime | None = None
_runtime_lock = threading.Lock()


def codec_engine() -> str:
    """Which code encodes and decodes this runner's blocks, and why (logged once at the start).

    Always the Numba kernels for now: mlx_ops is used only where benchmarks/bench_mlx.py has
    measured it faster, and so far it has been measured on mlx[cpu] only, where it is slower."""
    device = mx.default_device()
    why = (
        "tierkv.quant.mlx_ops measured slower than Numba with mlx[cpu] (benchmarks/bench_mlx.py)"
        if device.type == mx.cpu
        else f"tierkv.quant.mlx_ops is untested on {device} (Metal); measure it with "
        "benchmarks/bench_mlx.py first"
    )
    return f"KV blocks are encoded and decoded by the Numba kernels on the host: {why}"


def report_once(topic: str, message: str, *args: object) -> None:
    """Log a warning the first time `topic` comes up in this process."""
    if topic not in _reported:
        _reported.add(topic)
        log.warning("" + message, *args)


# ---- patching ----------------------------------------------------------------------------------


def patch_module(module: ModuleType) -> None:
    """Wrap what tierkv hooks in a freshly imported EXO module (idempotent; off when disabled)."""
    if disabled():
        return
    if module.__name__ == CACHE_MODULE:
        patch_prefix_cache(module.KVPrefixCache)
    elif module.__name__ == BOOTSTRAP_MODULE:
        members = vars(module)
        members["entrypoint"] = _wrap_entrypoint(members["entrypoint"])


def _wrap_entrypoint(entrypoint: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(entrypoint, _PATCHED, False):
        return entrypoint

    @functools.wraps(entrypoint)
    def wrapped(bound_instance: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            bind_shard(bound_instance.bound_shard)
        except Exception as exc:
            report_once("shard", "cannot read EXO's bound shard (%r); the hook stays off", exc)
        return entrypoint(bound_instance, *args, **kwargs)

    setattr(wrapped, _PATCHED, True)
    return wrapped


def bind_shard(shard: Any) -> None:
    """Remember what this runner holds, from EXO's Pipeline/TensorShardMetadata."""
    global _shard
    kind = type(shard).__name__
    model_id = str(shard.model_card.model_id)
    if kind.startswith("Pipeline"):
        _shard = ShardContext(model_id, int(shard.start_layer), weights=_weights_of(shard))
    elif kind.startswith("Tensor"):
        _shard = ShardContext(
            model_id, 0, int(shard.device_rank), int(shard.world_size), _weights_of(shard)
        )
    else:
        report_once("shard", "EXO shard kind %s is not supported; the hook stays off", kind)


def _weights_of(shard: Any) -> str | None:
    """Fingerprint of the model's weight files where EXO keeps them; None (reported) if unknown."""
    try:
        from exo.download.download_utils import build_model_path

        weights = weights_fingerprint(build_model_path(shard.model_card.model_id))
    except Exception as exc:
        weights, why = None, repr(exc)
    else:
        why = "no weight files there"
    if weights is None:
        report_once(
            "weights",
            "cannot fingerprint the weight files of %s (%s): weights replaced under the same "
            "model id would restore stale KV; clear the vault after replacing them",
            shard.model_card.model_id,
            why,
        )
    return weights


def patch_prefix_cache(cls: type) -> None:
    """Wrap `__init__`, `get_kv_cache`, `add_kv_cache` and `_evict_if_needed` of KVPrefixCache."""
    if getattr(cls, _PATCHED, False):
        return
    init, get, add, evict = (getattr(cls, name) for name in HOOKED_METHODS)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        runtime()  # start connecting and compiling the codecs while EXO loads the model

    @functools.wraps(get)
    def get_kv_cache(self: Any, model: Any, prompt_tokens: Any, *args: Any, **kwargs: Any) -> Any:
        result = get(self, model, prompt_tokens, *args, **kwargs)
        # Image tokens are placeholders: equal ids do not mean equal content. Never restore them.
        media = kwargs.get("media_regions", args[0] if args else None)
        try:
            return runtime().restore(self, model, prompt_tokens, result, allowed=not media)
        except Exception as exc:
            report_once("restore", "restore failed (%r); EXO's own result is used", exc)
            return result

    @functools.wraps(add)
    def add_kv_cache(self: Any, prompt_tokens: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
        result = add(self, prompt_tokens, cache, *args, **kwargs)
        try:
            current = runtime()
            if current.write_through and not _has_media(self, len(self.caches) - 1):
                current.offer(self.prompts[-1], self.caches[-1])
        except Exception as exc:
            report_once("spill", "spilling an entry failed (%r)", exc)
        return result

    @functools.wraps(evict)
    def _evict_if_needed(self: Any, *args: Any, **kwargs: Any) -> Any:
        current = runtime()
        if not current.ready.is_set():
            return evict(self, *args, **kwargs)
        prompts, caches = self.prompts, self.caches
        with_media = {id(caches[i]) for i in range(len(caches)) if _has_media(self, i)}
        popped_prompts: dict[int, Any] = {}

        def spill(index: int, cache: Any) -> None:
            prompt = popped_prompts.pop(index, None)
            if id(cache) not in with_media:
                current.offer(prompt, cache)

        self.prompts = _PopTap(prompts, popped_prompts.__setitem__)
        self.caches = _PopTap(caches, spill)
        try:
            return evict(self, *args, **kwargs)
        finally:
            prompts[:] = self.prompts
            caches[:] = self.caches
            self.prompts, self.caches = prompts, caches

    for name, method in zip(
        HOOKED_METHODS, (__init__, get_kv_cache, add_kv_cache, _evict_if_needed), strict=True
    ):
        setattr(cls, name, method)
    setattr(cls, _PATCHED, True)


def _has_media(prefix_cache: Any, index: int) -> bool:
    """Whether entry `index` holds image tokens (EXO >= v1.0.70 keeps their regions)."""
    regions = getattr(prefix_cache, "_media_regions", None)
    return bool(regions and index < len(regions) and regions[index])


class _PopTap(list[Any]):
    """A list that reports every `pop(i)` (how EXO's eviction drops an entry)."""

    def __init__(self, items: list[Any], on_pop: Callable[[int, Any], None]) -> None:
        super().__init__(items)
        self._on_pop = on_pop

    def pop(self, index: Any = -1) -> Any:
        item = super().pop(index)
        try:
            self._on_pop(index if index >= 0 else len(self) + 1 + index, item)
        except Exception as exc:
            report_once("spill", "spilling an evicted entry failed (%r)", exc)
        return item


# ---- the runtime -------------------------------------------------------------------------------


def runtime() -> ExoRuntime:
    """This process's runtime, started on first use (connects and warms up in the background)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = ExoRuntime(load_config)
        return _runtime


def shutdown() -> None:
    """Stop this process's runtime (pending spills are dropped); the next use starts a new one."""
    global _runtime
    with _runtime_lock:
        current, _runtime = _runtime, None
    if current is not None:
        current.close()


atexit.register(shutdown)


class ExoRuntime:
    """The cold tier, the spill thread and the restore logic of one EXO runner process."""

    def __init__(self, config_loader: Callable[[], TierKVConfig]) -> None:
        self.tier: ColdTier | None = None
        self.block_tokens = 256
        self.write_through = False
        self.ready = threading.Event()
        self.dropped_spills = 0
        self._kernels: dict[tuple[str, bool], threading.Event] = {}
        """(dtype, multi-threaded) -> set once compiling those kernels is over."""
        self._spill_budget = 0
        self._staged_bytes = 0  # block copies handed to the tier that it is not done with
        self._lock = threading.Lock()
        self._staged = threading.Condition(self._lock)
        self._spills: queue.Queue[_Spill | None] = queue.Queue(MAX_QUEUED_SPILLS)
        self._closed = False
        self._starter = threading.Thread(
            target=self._start, args=(config_loader,), name="tierkv-exo-start", daemon=True
        )
        self._spiller = threading.Thread(target=self._spill_loop, name="tierkv-spill", daemon=True)
        self._starter.start()

    def _start(self, config_loader: Callable[[], TierKVConfig]) -> None:
        try:
            cfg = resolve_auto_codec(config_loader(), lambda: _shard.weights if _shard else None)
            if not cfg.cluster.kv_cold:
                report_once("config", "no kv_cold vault in %s; EXO runs without tierkv", cfg.source)
                return
            self.block_tokens = cfg.exo.block_tokens
            self.write_through = cfg.exo.write_through
            self._spill_budget = cfg.connector.staging_bytes
            tier = ColdTier.from_config(cfg, warm_dtypes=())
            # MLX models keep their KV in bf16, and blocks of one layer are mostly far below
            # PARALLEL_MIN_BYTES: compile that now, anything else once a prompt needs it.
            seconds = tier.warm_up(("bf16",), largest_block_bytes=0)
            log.info(
                "%s and lossless kernels for bf16 (single-threaded) ready in %.1f s",
                tier.codec.name,
                seconds,
            )
            if note := line_rate_note(tier.codec, "bf16"):  # lossy codecs only
                log.info(note)
            log.info("%s", codec_engine())
            with self._lock:
                if self._closed:
                    tier.close()
                    return
                self.tier = tier
                self._kernels[("bf16", False)] = threading.Event()
                self._kernels[("bf16", False)].set()
            self._spiller.start()
            self.ready.set()
        except Exception as exc:
            report_once("start", "cannot start the cold tier (%r); EXO runs without tierkv", exc)

    def close(self) -> None:
        with self._staged:
            self._closed = True
            tier, self.tier = self.tier, None
            self._staged.notify_all()
        self.ready.clear()
        if self._spiller.is_alive():
            self._spills.put(None)
            self._spiller.join(timeout=10)
        if tier is not None:
            tier.close()

    # ---- kernels ----

    def kernels_ready(self, geometry: Geometry) -> bool:
        """Whether the kernels blocks of `geometry` use are compiled; if not, start compiling
        them in the background (once) and say False."""
        dtype = _DTYPES[geometry.dtype][0]
        largest = geometry.block_bytes(self.block_tokens)
        need = (dtype, largest >= PARALLEL_MIN_BYTES)
        with self._lock:
            ready = self._kernels.get(need)
            if ready is None:
                ready = self._kernels[need] = threading.Event()
                threading.Thread(
                    target=self._compile,
                    args=(dtype, largest, ready),
                    name="tierkv-compile",
                    daemon=True,
                ).start()
        return ready.is_set()

    def _compile(self, dtype: str, largest: int, ready: threading.Event) -> None:
        """Compile what blocks of `dtype` and `largest` bytes use, then set `ready` (also after
        a failure, reported: the blocks then fail as they would have, as misses)."""
        try:
            tier = self.tier
            if tier is None:
                return
            seconds = tier.warm_up((dtype,), largest)
            log.info(
                "%s and lossless kernels for %s blocks of %d bytes (%s) ready in %.1f s",
                tier.codec.name,
                dtype,
                largest,
                "multi-threaded" if largest >= PARALLEL_MIN_BYTES else "single-threaded",
                seconds,
            )
        except Exception as exc:
            report_once("compile", "compiling the %s kernels failed (%r)", dtype, exc)
        finally:
            ready.set()

    # ---- identity ----

    def namespace(self, geometry: Geometry, layout: Layout = PLAIN) -> bytes | None:
        if _shard is None:
            report_once("shard", "no EXO shard bound in this process; the hook stays off")
            return None
        rotating = {}
        if layout.window is not None:  # (absent for plain layers: their blocks stay valid)
            rotating["rotating"] = {
                "max_size": layout.window.max_size,
                "keep": layout.window.keep,
                "layers": [_shard.start_layer + i for i in layout.rotating],
            }
        return namespace_fingerprint(
            {
                **rotating,
                "engine": "exo",
                "format": FORMAT_VERSION,
                "model": _shard.model_id,
                "weights": _shard.weights,
                "heads": [_shard.head_rank, _shard.head_ranks],
                "kv_heads": geometry.kv_heads,
                "key_dim": geometry.key_dim,
                "value_dim": geometry.value_dim,
                "dtype": _DTYPES[geometry.dtype][0],
                "block_tokens": self.block_tokens,
            }
        )

    def parts(self, layers: Iterable[int]) -> list[int]:
        """The parts of `layers` (indices in this runner's slice): keys, values for each."""
        start = _shard.start_layer if _shard is not None else 0
        return [2 * (start + i) + kind for i in layers for kind in (0, 1)]

    # ---- spill ----

    def offer(self, prompt_tokens: Any, cache: Sequence[Any] | None) -> None:
        """Queue an entry EXO lets go of for the spill thread (dropped and counted when
        MAX_QUEUED_SPILLS entries are already waiting).

        Runs on EXO's thread: only references are taken here (bf16 gets a zero-copy bits view).
        """
        if prompt_tokens is None or cache is None or not self.ready.is_set():
            return
        layout = cache_layout(cache)
        geometry = entry_geometry(cache)
        if layout is None or geometry is None or geometry.dtype not in _DTYPES:
            return
        self.kernels_ready(geometry)  # the spill's encoders wait for them if need be
        held = {i: _Held.of(cache[i]) for i in layout.rotating}
        b = self.block_tokens
        blocks = min(min(layer.offset for layer in cache), len(prompt_tokens)) // b
        while blocks > 0 and not self._holds_window(layout, held, blocks):
            blocks -= 1  # the rotating layers no longer hold the window before that point
        if blocks == 0:
            return
        layers = []
        for layer in cache:
            keys, values = layer.keys, layer.values
            if geometry.dtype == mx.bfloat16:
                keys, values = keys.view(mx.uint16), values.view(mx.uint16)
            layers.append((keys, values))
        mx.eval(layers)
        tokens = np.array(prompt_tokens, dtype=np.int64)
        try:
            self._spills.put_nowait(_Spill(tokens, layers, blocks, geometry, layout, held))
        except queue.Full:
            with self._lock:
                self.dropped_spills += 1
            report_once(
                "queue",
                "%d evicted entries already wait to spill: entry dropped",
                MAX_QUEUED_SPILLS,
            )

    def _holds_window(self, layout: Layout, held: dict[int, _Held], blocks: int) -> bool:
        """Whether every rotating layer holds each whole block of its window before `blocks`."""
        if layout.window is None:
            return True
        b = self.block_tokens
        window = layout.window.blocks(blocks * b, b)
        return all(
            layer.slots_of(i * b, (i + 1) * b) is not None
            for layer in held.values()
            for i in window
        )

    def _spill_loop(self) -> None:
        while (spill := self._spills.get()) is not None:
            try:
                self._spill(spill)
            except Exception as exc:
                report_once("spill", "spilling an evicted entry failed (%r)", exc)
            finally:
                self._spills.task_done()
        self._spills.task_done()

    def _spill(self, spill: _Spill) -> None:
        """Copy the entry's filled blocks (never its spare capacity) one block of one layer at a
        time into the tier, waiting while `staging_bytes` of copies are not yet done with (encoded,
        or for a lossless block, which is sent from the copy itself, sent)."""
        tier, namespace = self.tier, self.namespace(spill.geometry, spill.layout)
        if tier is None or namespace is None:
            return
        b, layout = self.block_tokens, spill.layout
        keys = chain_block_keys(spill.tokens[: spill.blocks * b], b)
        # (blocks, layers): every block of the plain layers, the window's of the rotating ones
        groups = [(list(range(spill.blocks)), layout.plain(len(spill.layers)))]
        if layout.window is not None:
            groups.append((layout.window.blocks(spill.blocks * b, b), list(layout.rotating)))
        dtype = _DTYPES[spill.geometry.dtype][0]
        budget = min(self._spill_budget, tier.max_pending_encode_bytes)
        views = [(np.asarray(k)[0], np.asarray(v)[0]) for k, v in spill.layers]  # no copies
        for blocks, layers in groups:
            if not layers:
                continue
            stored = tier.lookup(namespace, [keys[i] for i in blocks], {VAULT: self.parts(layers)})
            for index in blocks[stored:]:
                for layer in layers:
                    held = spill.held.get(layer)  # a rotating layer's tokens sit anywhere
                    slots = None if held is None else held.slots_of(index * b, (index + 1) * b)
                    for kind, array in enumerate(views[layer]):
                        heads, _, dim = array.shape
                        if not self._reserve(heads * b * dim * array.itemsize, budget):
                            return
                        block = (  # the copy: one block of one layer
                            np.ascontiguousarray(array[:, index * b : (index + 1) * b, :])
                            if slots is None
                            else np.take(array, slots, axis=1)
                        )
                        release = functools.partial(self._release, block.nbytes)
                        split = (0, block.shape[0] if kind == 0 else 0)  # all keys or all values
                        sinks = (1, SINK_TOKENS if index == 0 else 0)  # [heads, tokens, dim]
                        tier.store(
                            namespace,
                            keys[index],
                            self.parts([layer])[kind],
                            block,
                            dtype,
                            VAULT,
                            on_done=release,
                            kv_split=split,
                            sink_tokens=sinks,
                        )

    def _reserve(self, nbytes: int, window: int) -> bool:
        """Wait until `nbytes` more copies fit in `window`; False (entry dropped, counted) when
        one block alone is larger or the runtime is closing."""
        if nbytes > window:
            with self._lock:
                self.dropped_spills += 1
            report_once(
                "budget",
                "a block of %d bytes does not fit connector.staging_bytes (%d): entry dropped",
                nbytes,
                window,
            )
            return False
        with self._staged:
            while self._staged_bytes + nbytes > window and not self._closed:
                self._staged.wait(SPILL_WAIT_S)
            if self._closed:
                return False
            self._staged_bytes += nbytes
            return True

    def _release(self, nbytes: int) -> None:
        with self._staged:
            self._staged_bytes -= nbytes
            self._staged.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the kernels being compiled are ready and every queued spill is handed to
        the tier and acknowledged by the vault (False when `timeout` ran out first)."""
        if not self.ready.is_set():
            return True
        with self._lock:
            compiling = list(self._kernels.values())
        if not all(ready.wait(timeout) for ready in compiling):
            return False
        self._spills.join()
        tier = self.tier
        return tier is None or tier.flush(timeout)

    # ---- restore ----

    def restore(
        self,
        prefix_cache: Any,
        model: Any,
        prompt_tokens: Any,
        result: tuple[Any, ...],
        *,
        allowed: bool = True,
    ) -> tuple[Any, ...]:
        """EXO's `get_kv_cache` result, or one rebuilt from a longer prefix held by the vault.

        Every rank runs the same agreements (all_gather, minimum) whatever happens locally; a
        rank that is not `allowed` to restore (or cannot) offers 0, so nobody restores. Rotating
        layers are restored at the agreed point or not at all (their window is that point's):
        when any rank has them, a rank that loaded less than agreed makes every rank recompute.
        """
        group = getattr(prefix_cache, "_group", None)
        cache, remaining = result[0], result[1]
        local_hit = len(prompt_tokens) - len(remaining)
        plan = None
        try:
            if allowed:
                plan = self._plan(prefix_cache, model, cache, prompt_tokens, local_hit)
        except Exception as exc:
            report_once("lookup", "vault lookup failed (%r); EXO's own cache is used", exc)
        offered = plan.tokens if plan is not None and plan.tokens > local_hit else 0
        (agreed,) = agree_min([offered], group)
        if agreed == 0:
            return result
        loaded = 0
        restored: list[tuple[mx.array, mx.array]] = []
        try:
            if plan is not None:
                loaded, restored = self._load(plan, agreed)
        except Exception as exc:
            report_once("load", "restoring from the vault failed (%r); recomputing", exc)
        rotating = plan is not None and plan.layout.window is not None
        usable, none_rotate = agree_min(
            [loaded if loaded > local_hit else 0, int(not rotating)], group
        )
        if usable < agreed and not none_rotate:
            usable = 0
        if usable == 0:
            return result
        for layer, (keys, values) in zip(cache, restored, strict=True):
            if type(layer) is RotatingKVCache:
                layer.keys, layer.values, layer._idx = keys, values, keys.shape[2]
            else:
                layer.keys = keys[:, :, :usable, :]
                layer.values = values[:, :, :usable, :]
            layer.offset = usable
        log.info("restored %d of %d prompt tokens from the vault", usable, len(prompt_tokens))
        rebuilt = (cache, prompt_tokens[usable:], None, False)
        return rebuilt[: len(result)]

    def _plan(
        self, prefix_cache: Any, model: Any, cache: Sequence[Any], prompt_tokens: Any, hit: int
    ) -> _Plan | None:
        tier = self.tier
        if tier is None or not self.ready.is_set():
            return None
        layout = cache_layout(cache)
        if layout is None:
            return None
        b = self.block_tokens
        blocks = (len(prompt_tokens) - 1) // b  # leave EXO at least one token to feed
        if blocks * b <= hit:
            return None
        geometry = known_geometry(prefix_cache.caches) or model_geometry(model)
        if geometry is None or geometry.dtype not in _DTYPES:
            return None
        if not self.kernels_ready(geometry):
            return None  # still compiling: this prompt is prefilled, the next ones restored
        namespace = self.namespace(geometry, layout)
        if namespace is None:
            return None
        tokens = np.array(prompt_tokens[: blocks * b], dtype=np.int64)
        keys = chain_block_keys(tokens, b)
        plain = layout.plain(len(cache))
        found = tier.lookup(namespace, keys, {VAULT: self.parts(plain)}) if plain else blocks
        if layout.window is not None:
            found = self._window_hit(namespace, keys[:found], layout, hit)
        return _Plan(found * b, keys[:found], namespace, geometry, len(cache), layout)

    def _window_hit(self, namespace: bytes, keys: list[bytes], layout: Layout, hit: int) -> int:
        """The most of `keys` (blocks) before whose end the vault holds the rotating layers'
        window (at most MAX_WINDOW_PROBES lookups; 0 if none is found beyond `hit` tokens)."""
        assert self.tier is not None and layout.window is not None
        b, blocks = self.block_tokens, len(keys)
        parts = {VAULT: self.parts(layout.rotating)}
        for _ in range(MAX_WINDOW_PROBES):
            if blocks * b <= hit:
                break
            window = layout.window.blocks(blocks * b, b)
            held = self.tier.lookup(namespace, [keys[i] for i in window], parts)
            if held == len(window):
                return blocks
            blocks = window[held]  # block `window[held]` is missing: the window must end before
        return 0

    def _load(self, plan: _Plan, tokens: int) -> tuple[int, list[tuple[mx.array, mx.array]]]:
        """(tokens restored, each layer's keys and values): the first `tokens` tokens of every
        plain layer, and the window before `tokens` of every rotating one. Without rotating
        layers, only the blocks before the first one that fails are kept; with them, all or
        nothing (0, [])."""
        tier = self.tier
        if tier is None:
            return 0, []
        b, layout = self.block_tokens, plan.layout
        count = tokens // b
        arrays: dict[int, mx.array] = {}  # part -> its keys or values
        plain = layout.plain(plan.layers)
        usable = count
        if plain:
            usable, got = self._fetch(plan, plan.keys[:count], plain)
            if usable == 0 or (usable < count and layout.window is not None):
                return 0, []
            arrays.update(got)
        if layout.window is not None:
            blocks = layout.window.blocks(count * b, b)
            held, got = self._fetch(plan, [plan.keys[i] for i in blocks], list(layout.rotating))
            if held < len(blocks):
                return 0, []
            # where each position of the window sits in the blocks fetched
            positions = layout.window.positions(count * b)
            at = np.searchsorted(blocks, positions // b) * b + positions % b
            arrays.update((part, array[:, :, mx.array(at), :]) for part, array in got.items())
        parts = self.parts(range(plan.layers))
        restored = [(arrays[k], arrays[v]) for k, v in zip(parts[0::2], parts[1::2], strict=True)]
        mx.eval(restored)
        return usable * b, restored

    def _fetch(
        self, plan: _Plan, keys: list[bytes], layers: list[int]
    ) -> tuple[int, dict[int, mx.array]]:
        """Fetch and decode `keys` (blocks) of `layers`: how many leading blocks arrived whole,
        and for each part those blocks side by side, (1, heads, blocks x block_tokens, dim)."""
        assert self.tier is not None
        b, g = self.block_tokens, plan.geometry
        parts = self.parts(layers)
        host_dtype = _DTYPES[g.dtype][1]
        staging = {
            part: np.empty(
                (len(keys), g.kv_heads, b, g.value_dim if part % 2 else g.key_dim), host_dtype
            )
            for part in parts
        }
        failed = self.tier.load(plan.namespace, keys, {VAULT: parts}, lambda i, p: staging[p][i])
        usable = min(failed, default=len(keys))
        got = {}
        for part, blocks in staging.items():
            array = mx.array(blocks[:usable]).transpose(1, 0, 2, 3)
            array = array.reshape(1, g.kv_heads, usable * b, blocks.shape[-1])
            got[part] = array.view(g.dtype) if g.dtype == mx.bfloat16 else array
        return usable, got


# ---- helpers -----------------------------------------------------------------------------------


def cache_layout(cache: Sequence[Any]) -> Layout | None:
    """Which layers are mlx-lm RotatingKVCache, and their window; None if some layer is of
    another kind than those and plain KVCache, or rotating layers differ in window (reported
    once)."""
    rotating, windows = [], set()
    for i, layer in enumerate(cache):
        if type(layer) is RotatingKVCache:
            rotating.append(i)
            windows.add(Window(int(layer.max_size), int(layer.keep)))
        elif type(layer) is not KVCache:
            kind = type(layer).__name__
            report_once(f"kind:{kind}", "%s layers are left to EXO's own cache path", kind)
            return None
    if len(windows) > 1:
        report_once(
            "windows",
            "RotatingKVCache layers of different windows are left to EXO's own cache path",
        )
        return None
    return Layout(windows.pop(), tuple(rotating)) if windows else PLAIN


def entry_geometry(cache: Sequence[Any]) -> Geometry | None:
    """The geometry of a filled cache of the kinds handled; None if empty, mixed or not."""
    if not cache or cache_layout(cache) is None or any(layer.keys is None for layer in cache):
        return None
    found = {
        Geometry(layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3], layer.keys.dtype)
        for layer in cache
    }
    if len(found) != 1 or any(layer.keys.shape[0] != 1 for layer in cache):
        report_once("geometry", "layers of different shapes or batches are not supported")
        return None
    return found.pop()


def known_geometry(caches: Sequence[Sequence[Any]]) -> Geometry | None:
    """The geometry of the first filled entry of EXO's prefix cache."""
    for cache in caches:
        if (geometry := entry_geometry(cache)) is not None:
            return geometry
    return None


def model_geometry(model: Any) -> Geometry | None:
    """The KV geometry read from an mlx-lm model's `args` (a guess: the namespace includes it,
    so a wrong guess is a miss, never a wrong restore)."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    if args is None or not heads:
        return None
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    if _shard is not None and _shard.head_ranks > 1:
        kv_heads //= _shard.head_ranks
    parameters: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    dtypes = [a.dtype for _, a in parameters if a.dtype in _DTYPES]
    return Geometry(kv_heads, head_dim, head_dim, dtypes[0]) if dtypes else None


def agree_min(values: Sequence[int], group: Any) -> list[int]:
    """The minimum of each of `values` over every rank of `group` (a collective: all ranks must
    call it, with as many values)."""
    if group is None or group.size() == 1:
        return list(values)
    mine = mx.array([float(value) for value in values], dtype=mx.float32)
    every = np.array(mx.distributed.all_gather(mine, group=group)).reshape(-1, len(values))
    return [int(value) for value in every.min(axis=0)]
