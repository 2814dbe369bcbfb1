"""The catalogue of codec and dtype names: each codec, its bits, K/V pair names, each dtype, its
size and how torch, numpy and MLX spell it, written down once.

tierkv.config validates `[compression] codec` against it and tierkv.quant writes its ids into
payload headers, so it imports only the standard library. The codecs themselves are tierkv.quant.
"""

from __future__ import annotations

import re

CODEC_NAMES = (
    "none",
    "int8",
    "tq4",
    "tq3.5",
    "tq3",
    "tq2.5",
    "tq2",
    "tq5c",
    "tq4c",
    "tq3c",
    "tq5s",
    "tq4s",
    "tq3s",
)
"""Every codec of tierkv.quant, in payload order: a payload's codec id is the index here (never
reorder: stored payloads would decode as another codec)."""
TURBO_QUANT_CODECS = CODEC_NAMES[1:]
"""The lossy codecs, which `[compression] codec` may name ("none" is lossless)."""
AUTO_CODEC = "auto"
"""`[compression] codec = "auto"`: the verdict `tierkv eval` recorded for the model, else none."""
TURBO_MODES = {
    "tq4": (4, 4, False),
    "tq3.5": (5, 3, True),
    "tq3": (3, 3, False),
    "tq2.5": (4, 2, True),
    "tq2": (2, 2, False),
}
"""TurboQuant's low-bit codecs: name -> (bits_hi, bits_lo, mixed). Mixed modes give a quarter of
the channels (32 of 128) bits_hi bits and the rest bits_lo."""
SINK_MODES = {
    "tq5c": (5, True),
    "tq4c": (4, True),
    "tq3c": (3, True),
    "tq5s": (5, False),
    "tq4s": (4, False),
    "tq3s": (3, False),
}
"""Key-aware TurboQuant (tierkv.quant.sinks): name -> (bits, centred). The sequence's first tokens
(attention sinks) stay lossless in its first block; "c" codecs also centre each channel on its
mean over the block's other tokens before the rotation (for keys), "s" codecs only keep the sinks
(for values)."""
LOSSY_BIT_LAYOUTS = {
    "int8": (8, 8, False),
    **TURBO_MODES,
    **{name: (bits, bits, False) for name, (bits, _) in SINK_MODES.items()},
}
"""The bits a payload header records for each lossy codec: name -> (bits_hi, bits_lo, mixed) as
in TURBO_MODES ("none" records its dtype's bits)."""
WHOLE_BLOCK_CODECS = tuple(name for name in CODEC_NAMES if name not in SINK_MODES)
"""The codecs made for a whole block, which `tierkv bench --codec all` compares; the key-aware
ones are halves of K/V pairs (the presets), benched by a pair's or preset's name."""
SINK_TOKENS = 4
"""Tokens at the start of a sequence the "c" and "s" codecs store lossless (the attention sinks)."""
PRESETS = {"kv4": "k4cv4s", "kv3": "k3cv3s"}
"""Named presets for users -> the K/V pair they are: kv4 (about 3.7x vs bf16 at head size 64,
3.8x at 128) and kv3 (about 4.8x / 5.0x); see docs/codecs.md."""
CODEC_BITS = {
    "none": "16",
    "int8": "8",
    "tq4": "4",
    "tq3.5": "3.5",
    "tq3": "3",
    "tq2.5": "2.5",
    "tq2": "2",
    "tq5c": "5c",
    "tq4c": "4c",
    "tq3c": "3c",
    "tq5s": "5s",
    "tq4s": "4s",
    "tq3s": "3s",
}
"""Each codec by its bits per value in a K/V pair's short name ("16": lossless)."""
_PAIR_RE = re.compile(r"^k([0-9.]+[cs]?)v([0-9.]+[cs]?)$")

DTYPES = ("fp16", "bf16", "fp32")
"""Every dtype the codecs take, in payload order: a payload's dtype code is the index here."""
DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}
"""Each dtype's code in a payload header (and in the kernels)."""
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
"""Bytes per value of each dtype."""
FRAMEWORK_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
"""Each dtype by the name torch, numpy (ml_dtypes for bfloat16) and MLX give its type, as in
`{getattr(torch, name): dtype for name, dtype in FRAMEWORK_DTYPES.items()}`."""


def kv_pair_name(keys: str, values: str) -> str:
    """The short name of keys stored with codec `keys` and values with `values` ("k8v4" for
    int8 + tq4); the plain codec name when both are the same. ValueError for an unknown codec."""
    for codec in (keys, values):
        if codec not in CODEC_BITS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {', '.join(CODEC_BITS)}")
    return keys if keys == values else f"k{CODEC_BITS[keys]}v{CODEC_BITS[values]}"


def kv_pair_codecs(name: str) -> tuple[str, str] | None:
    """(keys codec, values codec) of a K/V pair's short name like "k8v4" or a preset like
    "kv4"; None for other names.

    ValueError when `name` looks like a pair but names bits no codec has."""
    name = PRESETS.get(name, name)
    match = _PAIR_RE.match(name)
    if match is None:
        return None
    by_bits = {bits: codec for codec, bits in CODEC_BITS.items()}
    keys, values = (by_bits.get(bits) for bits in match.groups())
    if keys is None or values is None:
        raise ValueError(
            f"K/V pair {name!r}: bits must be one of {', '.join(by_bits)} (16 = lossless)"
        )
    return keys, values
