"""Pieces of the vLLM connector that need no engine: settings, keys of a request, statistics."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from tierkv.config import ConfigError
from tierkv.connectors.vllm.connector import connector_config
from tierkv.connectors.vllm.scheduler import request_keys
from tierkv.connectors.vllm.stats import TierKVStats
from tierkv.keys import chain_block_keys


def test_settings_inline_or_from_a_file(tmp_path: Path):
    inline = connector_config({"cluster.kv_cold": "127.0.0.1:5000", "connector.store": "on_finish"})
    assert inline.cluster.kv_cold == "127.0.0.1:5000"
    assert inline.connector.store == "on_finish"
    assert inline.source == "kv_connector_extra_config"

    path = tmp_path / "tierkv.toml"
    path.write_text('[cluster]\nkv_cold = "127.0.0.1:5001"\n')
    assert connector_config({"config_path": str(path)}).cluster.kv_cold == "127.0.0.1:5001"


def test_settings_errors_name_the_bad_thing(tmp_path: Path):
    with pytest.raises(ValueError, match=r"config_path.*cluster"):
        connector_config({"config_path": "x.toml", "cluster": {"kv_cold": "127.0.0.1:1"}})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config.*connector\.store"):
        connector_config({"connector.store": "sometimes"})
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        connector_config({"config_path": str(tmp_path / "missing.toml")})


def fake_request(tokens: list[int], **fields: object) -> SimpleNamespace:
    defaults = {
        "all_token_ids": tokens,
        "prompt_token_ids": tokens,
        "mm_features": [],
        "cache_salt": None,
        "lora_request": None,
    }
    return SimpleNamespace(**(defaults | fields))


def test_request_keys_follow_tokens_salt_and_lora():
    tokens = list(range(100))
    plain = request_keys(fake_request(tokens), 32)
    assert plain == chain_block_keys(tokens, 32)
    salted = request_keys(fake_request(tokens, cache_salt="tenant-a"), 32)
    lora = request_keys(fake_request(tokens, lora_request=SimpleNamespace(lora_name="a")), 32)
    assert salted is not None and lora is not None
    assert len({plain[0], salted[0], lora[0]}) == 3  # none can restore another's KV


def test_requests_whose_tokens_do_not_pin_the_kv_have_no_keys():
    assert request_keys(fake_request([1] * 64, mm_features=[object()]), 32) is None
    assert request_keys(fake_request([0] * 64, prompt_token_ids=None), 32) is None


def test_stats_intervals_and_aggregation():
    stats = TierKVStats()
    assert stats.take_interval() is None
    stats.observe_lookup(hit_blocks=3, asked_blocks=5, seconds=0.002)
    stats.add("loaded_blocks", 3)
    interval = stats.take_interval()
    assert interval is not None and interval.data["lookup_hit_blocks"] == 3
    assert stats.take_interval() is None  # nothing new since
    stats.add("loads")
    stats.add("load_seconds", 0.01)
    other = stats.take_interval()
    assert other is not None
    merged = interval.aggregate(other)
    reduced = merged.reduce()
    assert reduced["lookup_miss_blocks"] == 2 and reduced["loaded_blocks"] == 3
    assert reduced["avg_load_ms"] == pytest.approx(10.0)
    assert "load_seconds" not in reduced
