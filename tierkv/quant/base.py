"""The codec protocol and the codec family: what every codec of tierkv.quant is, and what the
modules that hold or combine codecs (codec, pair, torch_ops, mlx_ops) type them as."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tierkv.quant.payload import PayloadHeader, PayloadRun


class Codec(Protocol):
    """Turns a block into a self-describing payload; `decode_into` reverses any codec's payload."""

    name: str
    group_size: int

    def encode(self, src: np.ndarray, dtype: str | None = None) -> bytes:
        """Payload of `src` (dtype "fp16" | "bf16" | "fp32", inferred from float arrays)."""
        ...


@dataclass(frozen=True, eq=False)
class CodecFamily:
    """One module's codecs, as tierkv.quant.codec dispatches on them: every codec name it serves
    (`names`), its codec of a name and group size (`make`), the body length a payload must have
    (`body_bytes(header, body)`: PayloadError when impossible), the decode of a checked body into
    flat output words (`decode_body(header, body, out_words)`), and optionally the decode of a
    run of payloads with one header (`decode_run(header, run, out_rows, rows)`: which were
    decoded; None: decode_many leaves them to decode_into).

    A new codec: its name and bits in tierkv.codecs (appended to CODEC_NAMES, whose index is the
    payload id; CODEC_BITS; LOSSY_BIT_LAYOUTS, the bits its headers record), a module with its
    codec and its FAMILY (or a name added to a family's), and that FAMILY in
    tierkv.quant.codec.FAMILIES. Its torch decoders go in the tables keyed by family of torch_ops
    and torch_batch (_DECODERS), its MLX decoder in mlx_ops._DECODERS (and an encoder, if torch
    or MLX encodes it, in their _ENCODERS): those modules import torch / MLX, which this numpy
    core (and a vault) never imports."""

    names: tuple[str, ...]
    make: Callable[[str, int], Codec]
    body_bytes: Callable[[PayloadHeader, memoryview], int]
    decode_body: Callable[[PayloadHeader, np.ndarray, np.ndarray], None]
    decode_run: Callable[[PayloadHeader, PayloadRun, np.ndarray, np.ndarray], np.ndarray] | None = (
        None
    )
