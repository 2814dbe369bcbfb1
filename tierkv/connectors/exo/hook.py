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
size and FORMAT_VERSION. Only plain mlx-lm `KVCache` layers are handled; an entry with any other
cache kind is left to EXO's normal path (reported once per kind).

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
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from tierkv.config import TierKVConfig, load_config, resolve_auto_codec
from tierkv.connectors.exo.boot import BOOTSTRAP_MODULE, CACHE_MODULE, disabled
from tierkv.keys import chain_block_keys, namespace_fingerprint, weights_fingerprint
from tierkv.quant.kernels import PARALLEL_MIN_BYTES
from tierkv.quant.linerate import measure_line_rate
from tierkv.tier import ColdTier

log = logging.getLogger("tierkv.exo")

FORMAT_VERSION = 1
VAULT = "kv"
_PATCHED = "__tierkv_patched__"
HOOKED_METHODS = ("__init__", "get_kv_cache", "add_kv_cache", "_evict_if_needed")
MAX_QUEUED_SPILLS = 8
"""Evicted entries waiting for the spill thread (each holds EXO's arrays until it is spilled)."""
SPILL_WAIT_S = 0.5
"""How often a spill waiting for staging space checks whether the runtime is closing."""

# mlx dtype -> (codec dtype name, numpy dtype the host copy uses; bf16 travels as its bits)
_DTYPES: dict[Any, tuple[str, type[np.generic]]] = {
    mx.float16: ("fp16", np.float16),
    mx.bfloat16: ("bf16", np.uint16),
    mx.float32: ("fp32", np.float32),
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
class _Spill:
    """An evicted (or written-through) entry waiting for the spill thread."""

    tokens: np.ndarray
    layers: list[tuple[mx.array, mx.array]]
    cached_tokens: int
    geometry: Geometry


@dataclass(frozen=True)
class _Plan:
    """What this rank found in the vault for one prompt."""

    tokens: int
    keys: list[bytes]
    namespace: bytes
    geometry: Geometry
    layers: int


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
        log.warning("tierkv: " + message, *args)


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
                "tierkv: %s and lossless kernels for bf16 (single-threaded) ready in %.1f s",
                tier.codec.name,
                seconds,
            )
            if rate := measure_line_rate(tier.codec, "bf16"):  # lossy codecs only
                log.info("tierkv: %s", rate)
            log.info("tierkv: %s", codec_engine())
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
                "tierkv: %s and lossless kernels for %s blocks of %d bytes (%s) ready in %.1f s",
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

    def namespace(self, geometry: Geometry) -> bytes | None:
        if _shard is None:
            report_once("shard", "no EXO shard bound in this process; the hook stays off")
            return None
        return namespace_fingerprint(
            {
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

    def parts(self, layers: int) -> list[int]:
        start = _shard.start_layer if _shard is not None else 0
        return [2 * (start + i) + kind for i in range(layers) for kind in (0, 1)]

    # ---- spill ----

    def offer(self, prompt_tokens: Any, cache: Sequence[Any] | None) -> None:
        """Queue an entry EXO lets go of for the spill thread (dropped and counted when
        MAX_QUEUED_SPILLS entries are already waiting).

        Runs on EXO's thread: only references are taken here (bf16 gets a zero-copy bits view).
        """
        if prompt_tokens is None or cache is None or not self.ready.is_set():
            return
        geometry = entry_geometry(cache)
        if geometry is None or geometry.dtype not in _DTYPES:
            return
        self.kernels_ready(geometry)  # the spill's encoders wait for them if need be
        cached = min(layer.offset for layer in cache)
        if cached < self.block_tokens:
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
            self._spills.put_nowait(_Spill(tokens, layers, cached, geometry))
        except queue.Full:
            with self._lock:
                self.dropped_spills += 1
            report_once(
                "queue",
                "%d evicted entries already wait to spill: entry dropped",
                MAX_QUEUED_SPILLS,
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
        tier, namespace = self.tier, self.namespace(spill.geometry)
        if tier is None or namespace is None:
            return
        blocks = min(spill.cached_tokens, len(spill.tokens)) // self.block_tokens
        keys = chain_block_keys(spill.tokens[: blocks * self.block_tokens], self.block_tokens)
        parts = self.parts(len(spill.layers))
        stored = tier.lookup(namespace, keys, {VAULT: parts})
        dtype = _DTYPES[spill.geometry.dtype][0]
        window = min(self._spill_budget, tier.max_pending_encode_bytes)
        b = self.block_tokens
        views = [(np.asarray(k)[0], np.asarray(v)[0]) for k, v in spill.layers]  # no copies
        for index in range(stored, blocks):
            for layer, pair in enumerate(views):
                for kind, array in enumerate(pair):
                    view = array[:, index * b : (index + 1) * b, :]
                    if not self._reserve(view.nbytes, window):
                        return
                    block = np.ascontiguousarray(view)  # the copy: one block of one layer
                    release = functools.partial(self._release, block.nbytes)
                    part = parts[2 * layer + kind]
                    split = (0, block.shape[0] if kind == 0 else 0)  # all keys or all values
                    tier.store(
                        namespace,
                        keys[index],
                        part,
                        block,
                        dtype,
                        VAULT,
                        on_done=release,
                        kv_split=split,
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
        rank that is not `allowed` to restore (or cannot) offers 0, so nobody restores.
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
        agreed = agree_min(offered, group)
        if agreed == 0:
            return result
        restored: list[tuple[mx.array, mx.array]] = []
        try:
            if plan is not None:
                restored = self._load(plan, agreed)
        except Exception as exc:
            report_once("load", "restoring from the vault failed (%r); recomputing", exc)
        loaded = restored[0][0].shape[2] if restored else 0
        agreed = agree_min(loaded if loaded > local_hit else 0, group)
        if agreed == 0:
            return result
        for layer, (keys, values) in zip(cache, restored, strict=True):
            layer.keys = keys[:, :, :agreed, :]
            layer.values = values[:, :, :agreed, :]
            layer.offset = agreed
        log.info(
            "tierkv: restored %d of %d prompt tokens from the vault", agreed, len(prompt_tokens)
        )
        rebuilt = (cache, prompt_tokens[agreed:], None, False)
        return rebuilt[: len(result)]

    def _plan(
        self, prefix_cache: Any, model: Any, cache: Sequence[Any], prompt_tokens: Any, hit: int
    ) -> _Plan | None:
        tier = self.tier
        if tier is None or not self.ready.is_set() or not all_plain(cache):
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
        namespace = self.namespace(geometry)
        if namespace is None:
            return None
        tokens = np.array(prompt_tokens[: blocks * b], dtype=np.int64)
        keys = chain_block_keys(tokens, b)
        found = tier.lookup(namespace, keys, {VAULT: self.parts(len(cache))})
        return _Plan(found * b, keys[:found], namespace, geometry, len(cache))

    def _load(self, plan: _Plan, tokens: int) -> list[tuple[mx.array, mx.array]]:
        """Fetch and decode the first `tokens` tokens of every layer; [] when any block fails
        (then only the blocks before the first failure are kept)."""
        tier = self.tier
        if tier is None:
            return []
        b, g = self.block_tokens, plan.geometry
        count = tokens // b
        keys = plan.keys[:count]
        parts = self.parts(plan.layers)
        host_dtype = _DTYPES[g.dtype][1]
        staging = [
            np.empty((count, g.kv_heads, b, g.value_dim if part % 2 else g.key_dim), host_dtype)
            for part in parts
        ]
        by_part = dict(zip(parts, staging, strict=True))
        failed = tier.load(plan.namespace, keys, {VAULT: parts}, lambda i, p: by_part[p][i])
        usable = min(failed, default=count)
        if usable == 0:
            return []
        arrays = []
        for blocks in staging:
            array = mx.array(blocks[:usable]).transpose(1, 0, 2, 3)
            array = array.reshape(1, g.kv_heads, usable * b, blocks.shape[-1])
            arrays.append(array.view(g.dtype) if g.dtype == mx.bfloat16 else array)
        restored = list(zip(arrays[0::2], arrays[1::2], strict=True))
        mx.eval(restored)
        return restored


# ---- helpers -----------------------------------------------------------------------------------


def all_plain(cache: Sequence[Any]) -> bool:
    """Whether every layer is a plain mlx-lm KVCache (other kinds are reported once)."""
    for layer in cache:
        if type(layer) is not KVCache:
            kind = type(layer).__name__
            report_once(f"kind:{kind}", "%s layers are left to EXO's own cache path", kind)
            return False
    return True


def entry_geometry(cache: Sequence[Any]) -> Geometry | None:
    """The geometry of a filled cache of plain layers; None if empty, mixed or not plain."""
    if not cache or not all_plain(cache) or any(layer.keys is None for layer in cache):
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


def agree_min(value: int, group: Any) -> int:
    """The minimum of `value` over every rank of `group` (a collective: all ranks must call it)."""
    if group is None or group.size() == 1:
        return value
    every = mx.distributed.all_gather(mx.array([float(value)], dtype=mx.float32), group=group)
    return int(np.min(np.array(every)))
