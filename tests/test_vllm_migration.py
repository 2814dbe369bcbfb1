"""Session migration: a second vLLM engine process restores what the first one stored.

Block keys are content hashes plus a model fingerprint, so any engine of the same model finds a
session another one stored. One pair of engine processes shares the cold tier, spread over a
tierkv vault AND a real Redis server (`kv_cold = [vault, redis://...]`), so the one restore
crosses both backends: the second engine's greedy tokens equal the first's cold run, and both
stores show the promote (the vault's hits, Redis's GET calls) block for block.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import LOOPBACK
from redis_servers import RedisServer, start_redis
from test_vllm_connector import LLAMA_BLOCK, LLAMA_ENGINE, Engine, llama_fillers, prompt
from tiny_models import build_tiny_llama

from tierkv.backends import open_backend
from tierkv.backends.sharded import WeightedShards
from tierkv.backends.vault import VaultClient
from tierkv.config import ClientConfig, Endpoint
from tierkv.keys import chain_block_keys
from tierkv.vault.server import VaultServer, serve

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VaultServer, RedisServer]]:
    vault = serve(f"{LOOPBACK}:0", 0, role="kv_cold")
    redis_server = start_redis(tmp_path_factory.mktemp("redis"))
    yield vault, redis_server
    redis_server.stop()
    vault.stop(grace=0.5)


def redis_gets(server: RedisServer) -> int:
    stats = server.client().info("commandstats")
    return int(stats.get("cmdstat_get", {}).get("calls", 0))


def test_second_engine_process_restores_a_session_across_vault_and_redis(
    tmp_path: Path, stores: tuple[VaultServer, RedisServer]
) -> None:
    vault, redis_server = stores
    kv_cold = [vault.address, f"redis://{redis_server.address}"]
    model = build_tiny_llama(tmp_path / "llama", seed=0)
    first = Engine(model, {"cluster.kv_cold": kv_cold}, LLAMA_ENGINE)
    second = None
    try:
        tokens = prompt(40, 300)
        cold = first.store_and_evict(tokens, llama_fillers(40))
        second = Engine(model, {"cluster.kv_cold": kv_cold}, LLAMA_ENGINE)
        vault_hits, gets = vault.store.stats().hits, redis_gets(redis_server)

        assert second.generate(tokens) == cold

        restored = (len(tokens) - 1) // LLAMA_BLOCK  # every full block but vLLM's last token
        stats = second.stats()
        assert stats["loaded_blocks"] == restored and stats["load_failed_blocks"] == 0
        placement = open_backend([Endpoint(a) for a in kv_cold], ClientConfig())
        assert isinstance(placement, WeightedShards)
        keys = chain_block_keys(tokens, LLAMA_BLOCK)[:restored]
        on_vault = sum(isinstance(placement.owner(key), VaultClient) for key in keys)
        placement.close()
        assert 0 < on_vault < restored  # the restore crossed both stores
        assert vault.store.stats().hits - vault_hits == on_vault
        assert redis_gets(redis_server) - gets == restored - on_vault
    finally:
        first.close()
        if second is not None:
            second.close()
