"""Content keys: chained hashes of token blocks and namespace fingerprints.

A block key identifies a block by its own tokens *and* every token before it, so equal keys mean
equal prefixes. Keys are stable across processes and machines (unlike vLLM's per-process seeded
block hashes), which is what lets one engine restore what another stored.

A namespace fingerprints everything that makes stored bytes incompatible (model, dtype, layout,
codec, parallel rank...). Two engines share cached blocks only when their namespaces are equal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import xxhash

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)
"""The parent of the first block of every chain."""


def chain_block_keys(
    token_ids: Sequence[int] | np.ndarray, block_tokens: int, parent: bytes = ROOT_KEY
) -> list[bytes]:
    """One 16-byte key per *full* block of `block_tokens` tokens; a trailing partial block has none.

    key[i] = xxh3_128(key[i-1] || tokens of block i as little-endian int64). `parent` continues a
    chain (the key of the block before `token_ids[0]`).
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    tokens = np.ascontiguousarray(token_ids, dtype="<i8")
    keys: list[bytes] = []
    key = parent
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        key = xxhash.xxh3_128_digest(key + tokens[start : start + block_tokens].tobytes())
        keys.append(key)
    return keys


def namespace_fingerprint(fields: Mapping[str, object]) -> bytes:
    """A 16-byte fingerprint of `fields` (JSON-serialisable values); any difference changes it."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_digest(canonical.encode())


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
WEIGHT_SAMPLE_BYTES = 1 << 20


def weights_fingerprint(model_dir: str | Path) -> str | None:
    """A fingerprint of the weight files in `model_dir` (None when it holds none).

    Two copies of the same checkpoint agree wherever they live; weights replaced in place (a
    fine-tune saved over the same path and config) do not. Reading every byte would cost minutes
    at start-up, so each file contributes its name, size, and its first and last MiB, which hold
    tensor data that any retraining changes.
    """
    files = sorted(
        path
        for path in Path(model_dir).glob("*")
        if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES)
    )
    if not files:
        return None
    digest = xxhash.xxh3_128()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}:".encode())
        with path.open("rb") as weights:
            digest.update(weights.read(WEIGHT_SAMPLE_BYTES))
            weights.seek(max(0, size - WEIGHT_SAMPLE_BYTES))
            digest.update(weights.read(WEIGHT_SAMPLE_BYTES))
    return digest.hexdigest()
