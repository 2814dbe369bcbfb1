"""Codecs that turn KV blocks into compact, self-describing payloads and back (no I/O, no torch).

`get_codec(name, group_size)` gives a codec whose `encode` makes a payload; `decode_into` reads the
codec from the payload header and writes into a preallocated array. `torch_ops` does the same for
torch tensors and `mlx_ops` for MLX arrays (they import torch / MLX; import them explicitly).
"""

from tierkv.codecs import CODEC_NAMES, DTYPES
from tierkv.quant.base import Codec
from tierkv.quant.codec import (
    decode_into,
    decode_many,
    encode_block,
    get_codec,
    payload_shape,
    warmup,
)
from tierkv.quant.fidelity import Fidelity, fidelity
from tierkv.quant.payload import (
    NonFiniteError,
    PayloadError,
    PayloadHeader,
    read_header,
)

__all__ = [
    "CODEC_NAMES",
    "DTYPES",
    "Codec",
    "Fidelity",
    "NonFiniteError",
    "PayloadError",
    "PayloadHeader",
    "decode_into",
    "decode_many",
    "encode_block",
    "fidelity",
    "get_codec",
    "payload_shape",
    "read_header",
    "warmup",
]
