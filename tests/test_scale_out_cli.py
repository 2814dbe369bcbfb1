"""`tierkv status` and `tierkv bench` over several vaults and Valkey / Redis (real servers)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from helpers import VaultHandle
from typer.testing import CliRunner

from tests.redis_servers import start_redis
from tierkv.backends import open_backend
from tierkv.cli import app
from tierkv.config import ClientConfig, Endpoint

NS = b"status-namespace"


def test_status_lists_each_vault_with_its_share(
    vault_factory: Callable[..., VaultHandle], tmp_path: Path
) -> None:
    vaults = [vault_factory(), vault_factory()]
    redis_server = start_redis(tmp_path)
    try:
        addresses = [v.address for v in vaults]
        backend = open_backend([Endpoint(a) for a in addresses], ClientConfig())
        for index in range(2000):
            backend.put(NS, index.to_bytes(16, "little"), 0, b"x" * 100)
        assert backend.flush(timeout=60)
        backend.close()
        config = tmp_path / "tierkv.toml"
        config.write_text(
            f'[cluster]\nkv_cold = ["{addresses[0]}", {{ address = "{addresses[1]}" }}]\n'
            f'ssm_cold = "redis://:hunter2@{redis_server.address}"\n'
        )
        result = CliRunner().invoke(app, ["status", "--config", str(config), "--json"])
        assert result.exit_code == 0, result.output
        assert "hunter2" not in result.output
        rows = {row["name"]: row for row in json.loads(result.stdout)["vaults"]}
        assert set(rows) == {"kv_cold 1", "kv_cold 2", "ssm_cold"}
        shares = [rows[f"kv_cold {n}"]["entry_share"] for n in (1, 2)]
        assert sum(shares) == 1.0 and all(0.4 < share < 0.6 for share in shares)
        assert rows["ssm_cold"]["role"] == "redis standalone"
        assert rows["ssm_cold"]["bulk_port"] is None
        table = CliRunner().invoke(app, ["status", "--config", str(config), "--wide"])
        assert "n/a (redis)" in table.stdout and "hunter2" not in table.stdout
        bad = CliRunner().invoke(app, ["status", "--vault", "memcached://a:1"])
        assert bad.exit_code == 2 and "--vault: unknown scheme" in bad.output
    finally:
        redis_server.stop()


def test_bench_spreads_over_a_vault_and_redis_with_concurrent_workers(
    vault_factory: Callable[..., VaultHandle], tmp_path: Path
) -> None:
    vault = vault_factory()
    redis_server = start_redis(tmp_path)
    try:
        args = ["bench", "--tokens", "1024", "--model-shape", "llama-3.1-8b", "--codec", "none"]
        args += ["--vault", vault.address, "--vault", f"redis://{redis_server.address}"]
        result = CliRunner().invoke(app, [*args, "--workers", "2", "--json"])
        assert result.exit_code == 0, result.output
        figures = json.loads(result.stdout)
        assert figures["hit_blocks"] == figures["blocks"] == 4
        assert figures["workers"] == 2 and len(figures["worker_promote_gbps"]) == 2
        assert all(gbps > 0 for gbps in figures["worker_promote_gbps"])
        assert figures["aggregate_promote_gbps"] > 0
        assert redis_server.client().dbsize() == 0  # the bench cleared its blocks
    finally:
        redis_server.stop()
