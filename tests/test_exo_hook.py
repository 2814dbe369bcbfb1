"""The EXO hook end to end: a tiny random mlx-lm Llama, EXO's prompt cache armed by the real boot
module, and a real vault on loopback.

Every test that starts EXO runs against the EXO-shaped fixture package (`[fixture]`) and, with
`TIERKV_EXO_SRC=/path/to/exo`, against that real checkout's `cache.py` (`[real]`, skipped
otherwise; the few modules replaced around it are listed in fake_exo/real_exo.py)."""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from fake_exo.real_exo import RealExoFinder
from fake_exo.tiny_mlx import random_tokens, tiny_gemma3, tiny_llama
from fake_exo.tree import FIXTURE_SRC
from helpers import SLOW_BOX_MARGIN_S, VaultHandle
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache
from mlx_lm.models.llama import Model as LlamaModel
from mlx_lm.models.llama import ModelArgs

import tierkv.config as config_module
import tierkv.quant.codec as quant_codec
from tierkv.codecs import SINK_TOKENS
from tierkv.connectors.exo import boot, hook
from tierkv.keys import chain_block_keys, weights_fingerprint
from tierkv.quant import read_header
from tierkv.quant.kernels import Threaded
from tierkv.quant.payload import header_bytes
from tierkv.quant.sinks import PREFIX
from tierkv.seal import MAGIC as SEAL_MAGIC
from tierkv.seal import new_data_key_line

pytestmark = pytest.mark.mlx

BLOCK = 16
READY_TIMEOUT_S = 280
"""The first tier of a fresh checkout compiles every Numba kernel (minutes on 2 busy cores)."""
REAL_EXO_SRC = os.environ.get("TIERKV_EXO_SRC")


@dataclass
class Exo:
    """The fixture package as EXO's runner would see it, with the hook armed."""

    cache: ModuleType
    generate: ModuleType
    bootstrap: ModuleType


def start_exo(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vault_address: str,
    *,
    write_through: bool = False,
    block_tokens: int = BLOCK,
    staging_bytes: str = "64MiB",
    extra_config: str = "",
    exo_source: Path | None = None,
) -> Exo:
    """Point tierkv's config at `vault_address`, arm the boot hook, import EXO's modules (the
    fixture package, or the real checkout `exo_source`) and start a runner through EXO's entry
    point (which binds the shard)."""
    config = tmp_path / "tierkv.toml"
    config.write_text(
        f'[cluster]\nkv_cold = "{vault_address}"\n[client]\ndeadline_ms = 300\n'
        f'[connector]\nstaging_bytes = "{staging_bytes}"\n'
        f"[exo]\nblock_tokens = {block_tokens}\nwrite_through = {str(write_through).lower()}\n"
        + extra_config
    )
    monkeypatch.setenv("TIERKV_CONFIG", str(config))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in [m for m in sys.modules if m == "exo" or m.startswith("exo.")]:
        monkeypatch.delitem(sys.modules, name)
    boot.arm()
    if exo_source is None:
        monkeypatch.syspath_prepend(str(FIXTURE_SRC))
    else:  # behind the hook's finder, which finds EXO's modules through the others
        hooks = [i for i, finder in enumerate(sys.meta_path) if isinstance(finder, boot.HookFinder)]
        sys.meta_path.insert(hooks[0] + 1 if hooks else 0, RealExoFinder(exo_source))
    exo = Exo(
        importlib.import_module("exo.worker.engines.mlx.cache"),
        importlib.import_module("exo.worker.engines.mlx.generator.generate"),
        importlib.import_module("exo.worker.runner.bootstrap"),
    )
    if exo_source is not None:  # EXO's own prompt cache, not the fixture's
        assert Path(str(exo.cache.__file__)).is_relative_to(exo_source)
    start_runner(exo)
    return exo


def start_runner(exo: Exo) -> None:
    """EXO's runner entry point for the tiny model (which binds its shard)."""
    shard = type("PipelineShardMetadata", (), {})()
    shard.model_card = SimpleNamespace(model_id="tests/tiny-llama")
    shard.start_layer, shard.end_layer, shard.device_rank, shard.world_size = 0, 2, 0, 1
    exo.bootstrap.entrypoint(SimpleNamespace(bound_shard=shard, work=lambda: None), *[None] * 4)


@pytest.fixture(params=["fixture", "real"])
def exo_source(request: pytest.FixtureRequest) -> Path | None:
    """None for the fixture package; the real EXO checkout TIERKV_EXO_SRC (skipped without)."""
    if request.param == "fixture":
        return None
    if not REAL_EXO_SRC:
        pytest.skip("TIERKV_EXO_SRC (an EXO checkout) is not set")
    return Path(REAL_EXO_SRC)


def has_media_regions(exo: Exo) -> bool:
    """Whether this EXO's prompt cache knows image regions (EXO >= v1.0.70)."""
    return "media_regions" in inspect.signature(exo.cache.KVPrefixCache.get_kv_cache).parameters


@pytest.fixture(autouse=True)
def stop_runtime() -> Iterator[None]:
    yield
    hook.shutdown()


def evict_everything(exo: Exo, monkeypatch: pytest.MonkeyPatch, prefix_cache: Any) -> None:
    """What EXO does under memory pressure (EXO_MEMORY_THRESHOLD=0): the next add evicts."""
    monkeypatch.setattr(exo.cache, "_MEMORY_THRESHOLD", 0.0)
    prefix_cache._evict_if_needed()
    monkeypatch.setattr(exo.cache, "_MEMORY_THRESHOLD", 2.0)


def test_eviction_spills_and_the_next_request_restores_only_the_missing_suffix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vault: VaultHandle, exo_source: Path | None
) -> None:
    exo = start_exo(tmp_path, monkeypatch, vault.address, exo_source=exo_source)
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    model = tiny_llama(dtype=mx.bfloat16)
    prompt = random_tokens(100, seed=1)
    prefix_cache = exo.cache.KVPrefixCache(None)

    first = exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=3)
    assert first.prefilled == 100
    (entry,) = prefix_cache.caches
    # EXO >= v1.0.70 keeps len(prompt) - 2 tokens, older releases the generated ones too
    assert [layer.offset for layer in entry] == ([98, 98] if has_media_regions(exo) else [102, 102])
    stored_keys = np.array(entry[1].keys[..., :96, :].astype(mx.float32))

    evict_everything(exo, monkeypatch, prefix_cache)
    assert prefix_cache.caches == []
    assert runtime.flush(10)
    stats = runtime.tier.stats() if runtime.tier else {}
    assert stats["queued_blocks"] == 6 * 2 * 2  # 6 full blocks of 98 tokens, 2 layers, K and V
    assert vault.store.stats().entries == 24

    longer = mx.concatenate([prompt, random_tokens(20, seed=2)])
    cache, remaining, index, *exact = prefix_cache.get_kv_cache(model, longer)
    assert (len(remaining), index, exact) == (120 - 96, None, [False][: len(exact)])
    assert all(layer.offset == 96 for layer in cache)
    assert np.array_equal(np.array(cache[1].keys[..., :96, :].astype(mx.float32)), stored_keys)

    # EXO v1.0.68-v1.0.69 returned a 3-tuple: the rebuilt result keeps the caller's shape.
    plain = type(prefix_cache).get_kv_cache.__wrapped__(prefix_cache, model, longer)
    assert len(runtime.restore(prefix_cache, model, longer, plain[:3])) == 3

    restored = exo.generate.mlx_generate(model, longer, prefix_cache, max_tokens=6)
    cold = exo.generate.mlx_generate(model, longer, None, max_tokens=6)
    assert restored.prefilled == 24
    assert cold.prefilled == 120
    assert restored.tokens == cold.tokens


def test_sealed_blocks_restore_the_same_tokens_in_a_fresh_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vault: VaultHandle, exo_source: Path | None
) -> None:
    """With a data key, the blocks EXO spills reach the vault sealed, and a runtime started
    afresh (a new tier, a new sealer) restores them: the same greedy tokens as without tierkv."""
    keys = tmp_path / "data.keys"
    keys.write_text(new_data_key_line(1))
    keys.chmod(0o600)
    sealed = f'[security]\ndata_key_file = "{keys}"\n'
    exo = start_exo(
        tmp_path, monkeypatch, vault.address, extra_config=sealed, exo_source=exo_source
    )
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    model = tiny_llama(dtype=mx.bfloat16)
    prompt = random_tokens(100, seed=31)
    prefix_cache = exo.cache.KVPrefixCache(None)
    exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=3)
    evict_everything(exo, monkeypatch, prefix_cache)
    assert runtime.flush(10)
    payloads = list(vault.store.held().values())
    assert len(payloads) == 24 and all(bytes(payload[:4]) == SEAL_MAGIC for payload in payloads)
    hook.shutdown()

    exo = start_exo(
        tmp_path, monkeypatch, vault.address, extra_config=sealed, exo_source=exo_source
    )
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    prefix_cache = exo.cache.KVPrefixCache(None)
    longer = mx.concatenate([prompt, random_tokens(20, seed=32)])
    restored = exo.generate.mlx_generate(model, longer, prefix_cache, max_tokens=6)
    cold = exo.generate.mlx_generate(model, longer, None, max_tokens=6)
    assert restored.prefilled == 24 and restored.tokens == cold.tokens
    stats = runtime.tier.stats() if runtime.tier else {}
    assert stats["loaded_blocks"] > 0 and stats["open_failures"] == 0


def test_prompts_with_images_are_neither_spilled_nor_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vault: VaultHandle, exo_source: Path | None
) -> None:
    """Image tokens are placeholders: equal ids do not mean equal KV. An entry holding an image
    is never shipped, and a prompt with an image is never rebuilt from the vault."""
    exo = start_exo(tmp_path, monkeypatch, vault.address, exo_source=exo_source)
    if not has_media_regions(exo):
        pytest.skip("this EXO's prompt cache has no image regions (EXO < v1.0.70)")
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    media_region = importlib.import_module("exo.worker.engines.mlx.vision").MediaRegion
    model = tiny_llama()
    prefix_cache = exo.cache.KVPrefixCache(None)

    with_image = random_tokens(100, seed=20)
    exo.generate.mlx_generate(
        model, with_image, prefix_cache, max_tokens=1, media_regions=[media_region("cat", 10, 30)]
    )
    evict_everything(exo, monkeypatch, prefix_cache)
    assert runtime.flush(10)
    assert runtime.tier is not None and runtime.tier.stats()["queued_blocks"] == 0

    text = random_tokens(100, seed=21)
    exo.generate.mlx_generate(model, text, prefix_cache, max_tokens=1)
    evict_everything(exo, monkeypatch, prefix_cache)
    assert runtime.flush(10)
    assert runtime.tier.stats()["queued_blocks"] == 6 * 2 * 2  # 6 blocks, 2 layers, K and V
    longer = mx.concatenate([text, random_tokens(20, seed=22)])
    assert exo.generate.mlx_generate(model, longer, prefix_cache, max_tokens=2).prefilled == 24
    evict_everything(exo, monkeypatch, prefix_cache)

    image_there = [media_region("dog", 10, 30)]  # the same token ids now stand for an image
    again = exo.generate.mlx_generate(
        model, longer, prefix_cache, max_tokens=2, media_regions=image_there
    )
    assert again.prefilled == 120


def model_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes) -> Path:
    """A weight file of the tiny model where the EXO fixture's `build_model_path` finds it."""
    model_dir = tmp_path / "models" / "tests--tiny-llama"
    model_dir.mkdir(parents=True)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(content * 1000)
    monkeypatch.setenv("FAKE_EXO_MODELS_DIR", str(model_dir.parent))
    return weights


def test_weights_replaced_in_place_change_the_namespace(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vault: VaultHandle,
    caplog: pytest.LogCaptureFixture,
    exo_source: Path | None,
) -> None:
    weights = model_weights(tmp_path, monkeypatch, b"first fine-tune")
    exo = start_exo(tmp_path, monkeypatch, vault.address, exo_source=exo_source)
    runtime = hook.runtime()
    geometry = hook.Geometry(kv_heads=2, key_dim=16, value_dim=16, dtype=mx.bfloat16)
    first = runtime.namespace(geometry)

    weights.write_bytes(b"second fine-tune" * 1000)  # same path, same model id
    start_runner(exo)  # a new runner for the same model
    second = runtime.namespace(geometry)
    assert first is not None and second is not None and first != second

    monkeypatch.setenv("FAKE_EXO_MODELS_DIR", str(tmp_path / "elsewhere"))  # no weights found
    monkeypatch.setattr(hook, "_reported", set())  # earlier tests reported it already
    with caplog.at_level(logging.WARNING):
        start_runner(exo)  # a new runner for the same model
    assert runtime.namespace(geometry) not in (first, second)
    assert "cannot fingerprint the weight files of tests/tiny-llama" in caplog.text


@pytest.mark.parametrize("verdict", ["k8v4", None])
def test_codec_auto_stores_with_the_models_verdict_else_lossless(
    verdict: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vault: VaultHandle,
    caplog: pytest.LogCaptureFixture,
    exo_source: Path | None,
) -> None:
    fingerprint = weights_fingerprint(model_weights(tmp_path, monkeypatch, b"tiny").parent)
    verdicts = f'[codec_verdicts]\n"{fingerprint}" = "{verdict}"\n' if verdict else ""
    monkeypatch.setattr(config_module, "_told_auto", set())
    with (
        caplog.at_level(logging.INFO, logger="tierkv.config"),
        caplog.at_level(logging.INFO, logger="tierkv.exo"),
    ):
        exo = start_exo(
            tmp_path,
            monkeypatch,
            vault.address,
            extra_config='[compression]\nenabled = true\ncodec = "auto"\ngroup_size = 16\n'
            + verdicts,
            exo_source=exo_source,
        )
        runtime = hook.runtime()
        assert runtime.ready.wait(READY_TIMEOUT_S)
    assert runtime.tier is not None and runtime.tier.codec.name == (verdict or "none")
    said = "verdict for this model is k8v4" if verdict else f"no verdict for model {fingerprint}"
    assert caplog.text.count(said) == 1
    # a lossy codec says at start which link speeds its decode sustains on this CPU
    assert caplog.text.count("decode on this CPU") == (1 if verdict else 0)

    model = tiny_llama(dtype=mx.bfloat16)
    prompt = random_tokens(40, seed=3)
    prefix_cache = exo.cache.KVPrefixCache(None)
    exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=3)
    evict_everything(exo, monkeypatch, prefix_cache)
    assert runtime.flush(10)
    stored = {
        part: read_header(payload).codec for (_, _, part), payload in vault.store.held().items()
    }
    expected = {0: "int8", 1: "tq4"} if verdict else {0: "none", 1: "none"}
    assert stored == {part: expected[part % 2] for part in range(4)}  # keys even, values odd
    longer = mx.concatenate([prompt, random_tokens(8, seed=4)])
    restored = exo.generate.mlx_generate(model, longer, prefix_cache, max_tokens=3)
    assert restored.prefilled == 48 - 32


def test_a_sequences_first_block_keeps_its_sink_tokens_lossless(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vault: VaultHandle
) -> None:
    """With a sink codec (the kv4 preset) the spill stores the first block of a prompt with its
    first SINK_TOKENS tokens lossless along EXO's token axis ([heads, tokens, dim]), keys
    centred, and the later blocks without sinks; the prompt restores."""
    exo = start_exo(
        tmp_path,
        monkeypatch,
        vault.address,
        extra_config='[compression]\nenabled = true\ncodec = "kv4"\ngroup_size = 16\n',
    )
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    model = tiny_llama(dtype=mx.bfloat16)
    prompt = random_tokens(40, seed=3)
    prefix_cache = exo.cache.KVPrefixCache(None)
    exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=3)
    evict_everything(exo, monkeypatch, prefix_cache)
    assert runtime.flush(10)
    first = chain_block_keys(np.asarray(prompt), BLOCK)[0]
    held = vault.store.held()
    assert len(held) == 8  # 2 blocks of 2 layers, keys and values
    for (_, key, part), payload in held.items():
        header = read_header(payload)
        assert header.codec == ("tq4c" if part % 2 == 0 else "tq4s")
        at = header_bytes(len(header.shape))
        axis, centred, count = PREFIX.unpack(bytes(payload[at : at + PREFIX.size]))
        assert (axis, centred, count) == (1, part % 2 == 0, SINK_TOKENS if key == first else 0)
    longer = mx.concatenate([prompt, random_tokens(8, seed=4)])
    restored = exo.generate.mlx_generate(model, longer, prefix_cache, max_tokens=3)
    assert restored.prefilled == 48 - 32


def test_a_local_hit_as_long_as_the_vault_prefix_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vault: VaultHandle, exo_source: Path | None
) -> None:
    exo = start_exo(tmp_path, monkeypatch, vault.address, write_through=True, exo_source=exo_source)
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    model = tiny_llama()
    prompt = random_tokens(70, seed=3)
    prefix_cache = exo.cache.KVPrefixCache(None)
    exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=1)
    assert runtime.flush(10)
    assert runtime.tier is not None and runtime.tier.stats()["queued_blocks"] == 4 * 2 * 2

    exos_own = type(prefix_cache).get_kv_cache.__wrapped__(prefix_cache, model, prompt)
    assert len(exos_own[1]) < 70 - 64  # EXO's own hit (68 or 69 tokens) beats the vault's 64
    again = exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=4)
    assert again.prefilled == len(exos_own[1])
    assert again.tokens == exo.generate.mlx_generate(model, prompt, None, max_tokens=4).tokens


@pytest.mark.parametrize("never_up", [False, True])
def test_with_the_vault_down_exo_gives_the_same_tokens_as_without_tierkv(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vault: VaultHandle,
    free_port: int,
    never_up: bool,
    exo_source: Path | None,
) -> None:
    address = f"127.0.0.1:{free_port}" if never_up else vault.address
    exo = start_exo(tmp_path, monkeypatch, address, exo_source=exo_source)
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    model = tiny_llama()
    prompt = random_tokens(100, seed=4)
    prefix_cache = exo.cache.KVPrefixCache(None)
    exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=1)
    evict_everything(exo, monkeypatch, prefix_cache)
    runtime.flush(5)
    vault.stop()  # the spilled blocks die with it

    longer = mx.concatenate([prompt, random_tokens(20, seed=5)])
    started = time.monotonic()
    with_tierkv = exo.generate.mlx_generate(model, longer, prefix_cache, max_tokens=6)
    # At most about one 300 ms call deadline; a stall would wait out the 30 s promote deadline.
    assert time.monotonic() - started < 0.3 + SLOW_BOX_MARGIN_S
    without = exo.generate.mlx_generate(model, longer, None, max_tokens=6)
    assert with_tierkv.prefilled == 120
    assert with_tierkv.tokens == without.tokens


def quantizable_llama() -> Any:
    """A tiny Llama whose heads are 32 wide, the least MLX quantizes in groups."""
    mx.random.seed(0)
    args = ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=128,
        tie_word_embeddings=False,
    )
    return LlamaModel(args)


def generate_turns(
    exo: Exo, monkeypatch: pytest.MonkeyPatch, model: Any, prefix_cache: Any, prompts: list[Any]
) -> None:
    """Each prompt through EXO, then evicted and spilled (a conversation's turns)."""
    for prompt in prompts:
        exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=3)
        evict_everything(exo, monkeypatch, prefix_cache)
    assert hook.runtime().flush(10)


def skip_unless_stored_before_decoding(exo: Exo) -> None:
    """Rotating layers spill from EXO >= v1.0.70, which stores an entry before decoding."""
    if not has_media_regions(exo):
        pytest.skip(
            "EXO < v1.0.70 stores entries after decoding: their rotating layers hold the last "
            "window only, which ends on a block boundary only by chance (then nothing spills)"
        )


def test_sliding_window_layers_spill_their_window_and_restore_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vault: VaultHandle, exo_source: Path | None
) -> None:
    """Gemma 3's layout (local layers of a 32-token window, RotatingKVCache, between global
    ones): the global layers spill every block, the local ones the window before the restore
    point only; restored, the cache gives EXO's cold tokens, turn after turn."""
    exo = start_exo(tmp_path, monkeypatch, vault.address, exo_source=exo_source)
    skip_unless_stored_before_decoding(exo)
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    model = tiny_gemma3(window=32)
    prompt = random_tokens(100, seed=50)
    prefix_cache = exo.cache.KVPrefixCache(None)
    exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=3)
    (entry,) = prefix_cache.caches
    assert [type(layer) for layer in entry] == [RotatingKVCache, KVCache] * 2
    window = np.array(entry[2].keys[..., 64:96, :].astype(mx.float32))
    evict_everything(exo, monkeypatch, prefix_cache)
    assert runtime.flush(10)
    # 98 tokens: 6 blocks; local layers (parts 0, 1, 4, 5) only the 2 of the window [64, 96)
    blocks = Counter(part for _, _, part in vault.store.held())
    assert blocks == {0: 2, 1: 2, 4: 2, 5: 2, 2: 6, 3: 6, 6: 6, 7: 6}

    longer = mx.concatenate([prompt, random_tokens(20, seed=51)])
    cache, remaining, *_ = prefix_cache.get_kv_cache(model, longer)
    assert len(remaining) == 120 - 96
    assert [(layer.offset, layer.keys.shape[2]) for layer in cache] == [(96, 32), (96, 96)] * 2
    assert cache[2]._idx == 32
    assert np.array_equal(np.array(cache[2].keys.astype(mx.float32)), window)

    turns = [longer, mx.concatenate([longer, random_tokens(30, seed=52)])]
    for turn, restored_from in zip(turns, (96, 112), strict=True):
        restored = exo.generate.mlx_generate(model, turn, prefix_cache, max_tokens=8)
        cold = exo.generate.mlx_generate(model, turn, None, max_tokens=8)
        assert restored.prefilled == len(turn) - restored_from
        assert restored.tokens == cold.tokens
        evict_everything(exo, monkeypatch, prefix_cache)  # what the next turn restores from
        assert runtime.flush(10)


def test_nothing_stored_for_one_window_restores_into_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vault: VaultHandle, exo_source: Path | None
) -> None:
    """The namespace covers the window and which layers rotate: the same model id with a
    48-token window, or with every layer rotating, finds nothing the 32-token layout stored."""
    exo = start_exo(tmp_path, monkeypatch, vault.address, exo_source=exo_source)
    skip_unless_stored_before_decoding(exo)
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    prompt = random_tokens(100, seed=53)
    prefix_cache = exo.cache.KVPrefixCache(None)
    generate_turns(exo, monkeypatch, tiny_gemma3(window=32), prefix_cache, [prompt])
    assert runtime.tier is not None and runtime.tier.stats()["queued_blocks"] > 0
    longer = mx.concatenate([prompt, random_tokens(20, seed=54)])
    wider = tiny_gemma3(window=48)
    all_rotating = tiny_gemma3(window=32)
    all_rotating.make_cache = lambda: [RotatingKVCache(max_size=32) for _ in range(4)]
    for other in (wider, all_rotating):
        again = exo.generate.mlx_generate(other, longer, prefix_cache, max_tokens=2)
        assert again.prefilled == 120
        prefix_cache = exo.cache.KVPrefixCache(None)  # (its entry would be EXO's own hit)
    assert runtime.tier.stats()["loaded_blocks"] == 0
    restored = exo.generate.mlx_generate(tiny_gemma3(window=32), longer, prefix_cache, max_tokens=2)
    assert restored.prefilled == 120 - 96


@pytest.mark.parametrize("kind", ["QuantizedKVCache", "RotatingKVCache"])
def test_other_cache_kinds_are_left_to_exo_and_reported_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vault: VaultHandle,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    exo_source: Path | None,
) -> None:
    """Quantized caches (EXO's KV_CACHE_BITS), and rotating layers of two different windows,
    stay on EXO's own path."""
    exo = start_exo(tmp_path, monkeypatch, vault.address, exo_source=exo_source)
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    if kind == "RotatingKVCache":
        model = tiny_llama()
        model.make_cache = lambda: [RotatingKVCache(max_size=size) for size in (512, 256)]
    else:
        model = quantizable_llama()
        model.make_cache = lambda: [QuantizedKVCache(32, 8) for _ in model.layers]
    prefix_cache = exo.cache.KVPrefixCache(None)
    monkeypatch.setattr(hook, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="tierkv.exo"):
        for seed in (6, 7):
            prompt = random_tokens(60, seed=seed)
            exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=1)
            evict_everything(exo, monkeypatch, prefix_cache)
            again = exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=2)
            assert again.prefilled == 60
    assert runtime.flush(10)
    assert runtime.tier is not None and runtime.tier.stats()["queued_blocks"] == 0
    reports = [r for r in caplog.records if kind in r.getMessage()]
    assert len(reports) == 1


def test_recurrent_state_entries_are_left_to_exo(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vault: VaultHandle,
    caplog: pytest.LogCaptureFixture,
    exo_source: Path | None,
) -> None:
    """An entry with SSM layers (ArraysCache) and their snapshots is evicted without a spill."""
    exo = start_exo(tmp_path, monkeypatch, vault.address, exo_source=exo_source)
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    model = tiny_llama()
    prompt = random_tokens(60, seed=31)
    attention = [KVCache() for _ in model.layers]
    model(prompt[None], cache=attention)
    state = ArraysCache(2)
    state.cache = [mx.zeros((1, 4, 8)), mx.ones((1, 2, 8, 8))]
    cache = [state, attention[1]]
    prefix_cache = exo.cache.KVPrefixCache(None)
    snapshots = [exo.cache.snapshot_ssm_states(cache)]
    monkeypatch.setattr(hook, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="tierkv.exo"):
        prefix_cache.add_kv_cache(prompt, cache, ssm_snapshots=snapshots)
        evict_everything(exo, monkeypatch, prefix_cache)
    assert prefix_cache.caches == [] and prefix_cache._snapshots == []
    assert runtime.flush(10)
    assert runtime.tier is not None and runtime.tier.stats()["queued_blocks"] == 0
    assert any("ArraysCache" in r.getMessage() for r in caplog.records)


def test_a_full_spill_budget_drops_the_entry_and_counts_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vault: VaultHandle,
    caplog: pytest.LogCaptureFixture,
    exo_source: Path | None,
) -> None:
    exo = start_exo(
        tmp_path, monkeypatch, vault.address, staging_bytes="1KiB", exo_source=exo_source
    )
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    model = tiny_llama()
    prompt = random_tokens(100, seed=8)
    prefix_cache = exo.cache.KVPrefixCache(None)
    exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=1)
    monkeypatch.setattr(hook, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="tierkv.exo"):
        evict_everything(exo, monkeypatch, prefix_cache)
    assert runtime.flush(10)
    assert runtime.dropped_spills == 1
    assert runtime.tier is not None and runtime.tier.stats()["queued_blocks"] == 0
    assert any("staging_bytes" in r.getMessage() for r in caplog.records)


def test_an_entry_many_times_the_staging_budget_spills_block_by_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vault: VaultHandle, exo_source: Path | None
) -> None:
    """EXO allocates 256-token steps: 300 tokens of the bf16 tiny model are 128 KiB of arrays,
    32 times the 4 KiB budget; its filled blocks (1 KiB per layer and K or V) still all go."""
    exo = start_exo(
        tmp_path, monkeypatch, vault.address, staging_bytes="4KiB", exo_source=exo_source
    )
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    model = tiny_llama(dtype=mx.bfloat16)
    prompt = random_tokens(300, seed=11)
    prefix_cache = exo.cache.KVPrefixCache(None)
    exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=1)
    (entry,) = prefix_cache.caches
    allocated = sum(layer.keys.nbytes + layer.values.nbytes for layer in entry)
    assert allocated >= 16 * 4096
    evict_everything(exo, monkeypatch, prefix_cache)
    assert runtime.flush(30)
    assert runtime.dropped_spills == 0
    assert runtime.tier is not None and runtime.tier.stats()["queued_blocks"] == 18 * 2 * 2

    restored = exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=4)
    cold = exo.generate.mlx_generate(model, prompt, None, max_tokens=4)
    assert restored.prefilled == 300 - 18 * BLOCK
    assert restored.tokens == cold.tokens


def test_a_runner_compiles_only_the_kernels_its_blocks_use(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vault: VaultHandle,
    caplog: pytest.LogCaptureFixture,
    exo_source: Path | None,
) -> None:
    """The start compiles the codec for bf16, single-threaded: the tiny model's blocks (1 KiB)
    are far below PARALLEL_MIN_BYTES. Blocks that large (the bound lowered here) need the
    multi-threaded builds: the first prompt that needs them starts compiling them in the
    background and is prefilled by EXO meanwhile; once they are ready, prompts are restored."""
    compile_parallel = Threaded.compile_parallel
    parallel_builds: list[Threaded] = []
    gate = threading.Event()

    def gated(kernel: Threaded) -> None:
        assert gate.wait(READY_TIMEOUT_S)
        parallel_builds.append(kernel)
        compile_parallel(kernel)

    monkeypatch.setattr(Threaded, "compile_parallel", gated)
    with caplog.at_level(logging.INFO, logger="tierkv.exo"):
        exo = start_exo(tmp_path, monkeypatch, vault.address, exo_source=exo_source)
        runtime = hook.runtime()
        assert runtime.ready.wait(READY_TIMEOUT_S)
        assert "none and lossless kernels for bf16 (single-threaded) ready in" in caplog.text
        said = "encoded and decoded by the Numba kernels on the host: tierkv.quant.mlx_ops"
        assert caplog.text.count(said) == 1  # the choice, said once (mlx[cpu] here)

        # the tiny model's blocks (2 heads, 16 dims, bf16) count as large for the hook and the
        # warm-up; the kernels still run their single-threaded builds on blocks that small
        for module in (hook, quant_codec):
            monkeypatch.setattr(module, "PARALLEL_MIN_BYTES", 2 * BLOCK * 16 * 2)
        model = tiny_llama(dtype=mx.bfloat16)
        prompt = random_tokens(100, seed=40)
        prefix_cache = exo.cache.KVPrefixCache(None)
        exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=1)
        evict_everything(exo, monkeypatch, prefix_cache)  # its spill starts the compile
        runtime._spills.join()
        assert runtime.tier is not None and runtime.tier.flush(10)
        longer = mx.concatenate([prompt, random_tokens(20, seed=41)])
        assert exo.generate.mlx_generate(model, longer, prefix_cache, max_tokens=1).prefilled == 120
        assert parallel_builds == []

        gate.set()
        evict_everything(exo, monkeypatch, prefix_cache)
        assert runtime.flush(READY_TIMEOUT_S)
        assert parallel_builds
        assert "bf16 blocks of 1024 bytes (multi-threaded) ready in" in caplog.text
    restored = exo.generate.mlx_generate(model, longer, prefix_cache, max_tokens=4)
    cold = exo.generate.mlx_generate(model, longer, None, max_tokens=4)
    assert restored.prefilled == 120 - 7 * BLOCK  # the miss above was spilled too
    assert restored.tokens == cold.tokens


def test_a_bad_config_is_reported_and_exo_runs_as_without_tierkv(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vault: VaultHandle,
    caplog: pytest.LogCaptureFixture,
    exo_source: Path | None,
) -> None:
    monkeypatch.setattr(hook, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="tierkv.exo"):
        exo = start_exo(tmp_path, monkeypatch, vault.address, block_tokens=0, exo_source=exo_source)
        runtime = hook.runtime()
        runtime._starter.join(30)
    assert not runtime.ready.is_set()
    assert any("exo.block_tokens" in r.getMessage() for r in caplog.records)
    model = tiny_llama()
    prompt = random_tokens(60, seed=9)
    prefix_cache = exo.cache.KVPrefixCache(None)
    first = exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=3)
    evict_everything(exo, monkeypatch, prefix_cache)
    again = exo.generate.mlx_generate(model, prompt, prefix_cache, max_tokens=3)
    assert (first.prefilled, again.prefilled, again.tokens) == (60, 60, first.tokens)


def test_tierkv_disable_leaves_exo_unpatched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exo_source: Path | None
) -> None:
    monkeypatch.setenv("TIERKV_DISABLE", "1")
    exo = start_exo(tmp_path, monkeypatch, "127.0.0.1:1", exo_source=exo_source)
    assert not boot.arm()
    assert not hasattr(exo.cache.KVPrefixCache, "__tierkv_patched__")
    assert not hasattr(exo.bootstrap.entrypoint, "__tierkv_patched__")


def test_ranks_agree_on_the_shortest_restorable_prefix(
    tmp_path: Path, vault: VaultHandle, free_port: int, exo_source: Path | None
) -> None:
    """Two ring-backend ranks on loopback, pipeline then tensor shards (see fake_exo/two_ranks.py
    for the scenario)."""
    config = tmp_path / "tierkv.toml"
    config.write_text(f'[cluster]\nkv_cold = "{vault.address}"\n[exo]\nblock_tokens = {BLOCK}\n')
    script = Path(__file__).parent / "fake_exo" / "two_ranks.py"
    launcher = Path(sys.executable).parent / "mlx.launch"
    command = [str(launcher), "-n", "2", "-p", str(free_port), "--python", sys.executable]
    process = subprocess.Popen(
        [*command, str(script)],
        env={
            **{k: v for k, v in os.environ.items() if k != "TIERKV_EXO_SRC"},
            "TIERKV_CONFIG": str(config),
            **({"TIERKV_EXO_SRC": str(exo_source)} if exo_source else {}),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=2 * READY_TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    ranks = {r["rank"]: r for r in map(json.loads, re.findall(r"^\{.*\}$", output, re.M))}
    assert sorted(ranks) == [0, 1], output
    for rank in ranks.values():
        cold_prefilled, cold_tokens = rank["cold"]
        assert cold_prefilled == 120
        assert rank["partial"] == [120 - 3 * BLOCK, cold_tokens]  # rank 1 holds 3 blocks only
        assert rank["failed"] == [120, cold_tokens]  # rank 1's lookup failed: nobody restores
        prefilled, tokens, window_cold_tokens = rank["window"]  # rank 0 loaded 5 of 6 blocks
        assert (prefilled, tokens) == (120, window_cold_tokens)
        prefilled, tokens, tensor_cold_tokens = rank["tensor"]  # each rank holds its own heads
        assert (prefilled, tokens) == (120 - 6 * BLOCK, tensor_cold_tokens)
