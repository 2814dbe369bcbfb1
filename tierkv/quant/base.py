"""The codec protocol: what every codec of tierkv.quant is, and what the modules that hold or
combine codecs (codec, pair, torch_ops, mlx_ops) type them as."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Codec(Protocol):
    """Turns a block into a self-describing payload; `decode_into` reverses any codec's payload."""

    name: str
    group_size: int

    def encode(self, src: np.ndarray, dtype: str | None = None) -> bytes:
        """Payload of `src` (dtype "fp16" | "bf16" | "fp32", inferred from float arrays)."""
        ...
