"""Key-aware TurboQuant: a sequence's first tokens (attention sinks) lossless, keys centred.

A random rotation spreads a vector's error over its channels but does not remove a per-channel
offset, and a model's keys carry large ones (a k_proj bias, RoPE's low-frequency channels), which
then take most of TurboQuant's levels. The "c" codecs (tq5c, tq4c, tq3c; for keys) subtract each
channel's mean over the block's tokens (per head: per position of the block but its token axis),
stored in fp16, before the rotation and add it back after decoding; the "s" codecs (tq5s, tq4s,
tq3s; for values) do not centre. Both keep the first `sinks` tokens of the block lossless when
the caller says the block is its sequence's first (tier.store's `sinks`): the attention sinks,
which every later token attends to, and whose outsized keys would otherwise dominate the means.

Body: token axis u8 | centred u8 | sink tokens u16 (little-endian)
      | centred only: the means, fp16, one per position of the block without its token axis
      | the sink tokens' raw words: the block as [outer, tokens, inner] (tokens = its token
        axis), [:, :sinks, :] in C order
      | a TurboQuant body (tierkv.quant.turbo) of the block minus the means, sink tokens zero
The token axis must leave whole vectors of group_size values per token (inner % group_size == 0).
"""

from __future__ import annotations

import functools
import math
import struct
from functools import lru_cache

import numpy as np

from tierkv.codecs import DTYPE_BYTES, SINK_MODES
from tierkv.quant.base import CodecFamily
from tierkv.quant.payload import (
    WORD_TYPES,
    NonFiniteError,
    PayloadError,
    PayloadHeader,
    input_words,
    new_payload,
    pack_header,
)
from tierkv.quant.turbo import TurboCodec, check_group_size

PREFIX = struct.Struct("<BBH")
FLAT = 0xFF
"""The token axis of a block whose axes the encoder was not told and whose longer axis does not
hold whole vectors: each vector of group_size values its own token (no sinks)."""
Sinks = tuple[int, int]
"""(token axis, sink tokens): where a block's tokens run and how many of its first are kept
lossless (0 for every block but a sequence's first)."""
_FP16_MAX = 65504.0


def token_axis(shape: tuple[int, ...]) -> int:
    """The token axis of a block when the caller names none: of [..., a, b, d] the longer of a
    and b (a block holds more tokens than KV heads: vLLM's [tokens, heads, d], MLX's
    [heads, tokens, d]; ties: a), else axis 0."""
    if len(shape) < 3:
        return 0
    return len(shape) - 2 if shape[-2] > shape[-3] else len(shape) - 3


def geometry(shape: tuple[int, ...], axis: int, d: int) -> tuple[int, int, int]:
    """(outer, tokens, inner): the block as [outer, tokens, inner] values along token `axis`
    (FLAT or a 1-D block: each vector of d a token). ValueError when a token's values are not
    whole vectors of d."""
    if len(shape) == 1 or axis == FLAT:
        return 1, math.prod(shape) // d, d
    if not 0 <= axis < len(shape):
        raise ValueError(f"token axis {axis} does not fit a block of shape {shape}")
    inner = math.prod(shape[axis + 1 :])
    if inner % d:
        raise ValueError(
            f"token axis {axis} of a block of shape {shape} leaves {inner} values per token, "
            f"not whole vectors of group_size={d}"
        )
    return math.prod(shape[:axis]), shape[axis], inner


def as_float32(words: np.ndarray, dtype: str) -> np.ndarray:
    """Raw words of `dtype` as float32 values."""
    if dtype == "fp16":
        return words.view(np.float16).astype(np.float32)
    if dtype == "bf16":
        return (words.astype(np.uint32) << 16).view(np.float32)
    return words.view(np.float32)


class SinkTurboCodec:
    """TurboQuant at `bits` bits with sink tokens lossless, centred per channel if `centred`."""

    def __init__(self, name: str, group_size: int, bits: int, centred: bool) -> None:
        check_group_size(name, group_size)
        self.name = name
        self.group_size = group_size
        self.centred = centred
        self.turbo = TurboCodec(name, group_size, bits, bits, False)

    def encode(
        self, src: np.ndarray, dtype: str | None = None, sinks: Sinks | None = None
    ) -> bytes:
        """Payload of `src`; `sinks` = (token axis, how many first tokens stay lossless), None:
        the axis token_axis picks and no sinks. NonFiniteError for NaN/Inf."""
        words, dtype = input_words(src, dtype)
        shape = tuple(src.shape)
        self.turbo.check_encodable(words, shape)
        if sinks is None:
            axis, count = token_axis(shape), 0
            if len(shape) > 1 and math.prod(shape[axis + 1 :]) % self.group_size:
                axis = FLAT
        else:
            axis, count = sinks
            if len(shape) > 1 and -len(shape) <= axis < 0:
                axis %= len(shape)
        outer, tokens, inner = geometry(shape, axis, self.group_size)
        if not 0 <= count <= min(tokens, 0xFFFF):
            raise ValueError(f"{count} sink tokens do not fit a block of {tokens} tokens")
        x = as_float32(words, dtype).reshape(outer, tokens, inner)
        if not np.isfinite(x).all():
            raise NonFiniteError(f"block of shape {shape} holds NaN/Inf")
        means = np.zeros((outer, inner), np.float16)
        if self.centred and count < tokens:
            means[:] = np.clip(x[:, count:].mean(axis=1, dtype=np.float64), -_FP16_MAX, _FP16_MAX)
        residual = x - means.astype(np.float32)[:, None, :]
        residual[:, :count] = 0.0
        raw = words.reshape(outer, tokens, inner)[:, :count]
        turbo_layout = self.turbo.layout(shape)
        head = PREFIX.size + (means.nbytes if self.centred else 0) + raw.nbytes
        body_len = head + turbo_layout.body_bytes
        header = pack_header(self.name, dtype, shape, self.group_size, body_len)
        payload, body = new_payload(header, body_len)
        body[: PREFIX.size] = np.frombuffer(PREFIX.pack(axis, self.centred, count), np.uint8)
        at = PREFIX.size
        if self.centred:
            body[at : at + means.nbytes] = means.astype("<f2").reshape(-1).view(np.uint8)
            at += means.nbytes
        body[at:head] = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        flat = residual.reshape(-1).view(np.uint32)
        flat.flags.writeable = False  # the kernels' specialisation for read-only words
        self.turbo.encode_words(flat, "fp32", shape, body[head:])
        return payload

    def parts(self, header: PayloadHeader, body: np.ndarray) -> tuple[Parts, np.ndarray]:
        """The validated parts of a body (uint8) and its TurboQuant body; PayloadError when
        its prefix or length does not fit the header."""
        if len(body) < PREFIX.size:
            raise PayloadError(f"{self.name} payload body of {len(body)} bytes has no prefix")
        prefix = PREFIX.unpack(body[: PREFIX.size].tobytes())
        blocks, means_end, head, expected = self._spans(header.shape, header.dtype, prefix)
        if len(body) != expected:
            raise PayloadError(
                f"{self.name} payload body is {len(body)} bytes, shape {header.shape} with "
                f"{prefix[2]} sink tokens needs {expected}"
            )
        means, raw = body[PREFIX.size : means_end], body[means_end:head]
        return Parts(blocks, prefix[2], means, raw), body[head:]

    @functools.lru_cache(maxsize=256)  # noqa: B019 (the codecs live as long as the process)
    def _spans(
        self, shape: tuple[int, ...], dtype: str, prefix: tuple[int, int, int]
    ) -> tuple[tuple[int, int, int], int, int, int]:
        """(blocks, end of the means, end of the sink tokens, body length) of a body with this
        prefix; PayloadError when the prefix does not fit the shape."""
        axis, centred, count = prefix
        try:
            outer, tokens, inner = geometry(shape, axis, self.group_size)
        except ValueError as exc:
            raise PayloadError(f"invalid {self.name} payload: {exc}") from None
        if centred != self.centred or count > tokens:
            raise PayloadError(
                f"invalid {self.name} payload: centred {centred}, {count} sink tokens of {tokens}"
            )
        means_end = PREFIX.size + (2 * outer * inner if centred else 0)
        head = means_end + outer * count * inner * DTYPE_BYTES[dtype]
        return (outer, tokens, inner), means_end, head, head + self.turbo.layout(shape).body_bytes

    def decode_words(self, header: PayloadHeader, body: np.ndarray, out_words: np.ndarray) -> None:
        """Decode a body into the flat words of the output (PayloadError when malformed)."""
        parts, turbo_body = self.parts(header, body)
        _, tokens, inner = parts.blocks
        centre = (parts.means, inner // self.group_size, tokens)
        self.turbo.decode_words(turbo_body, header.dtype, header.shape, out_words, centre)
        parts.put_sinks(out_words)


class Parts:
    """What a body holds besides its TurboQuant body: the block as [outer, tokens, inner]
    (`blocks`), its sink tokens (`count`, their raw words as bytes `raw`) and its means (fp16
    bytes, none when not centred)."""

    def __init__(
        self, blocks: tuple[int, int, int], count: int, means: np.ndarray, raw: np.ndarray
    ) -> None:
        self.blocks, self.count, self.means, self.raw = blocks, count, means, raw

    def mean_values(self) -> np.ndarray:
        """The means as float32 [outer, 1, inner] (to add to the block as [outer, tokens,
        inner]); empty when not centred."""
        outer, _, inner = self.blocks
        values = self.means.view("<f2").astype(np.float32)
        return values.reshape(outer, 1, inner) if values.size else values

    def sink_words(self, word_bytes: int) -> np.ndarray:
        """The sink tokens' raw words as [outer, count, inner]."""
        outer, _, inner = self.blocks
        return self.raw.view(WORD_TYPES[word_bytes]).reshape(outer, self.count, inner)

    def put_sinks(self, out_words: np.ndarray) -> None:
        """Write the sink tokens' raw words into the decoded flat words."""
        if self.count:
            view = out_words.reshape(self.blocks)
            view[:, : self.count] = self.sink_words(out_words.itemsize)


@lru_cache(maxsize=64)
def named_codec(name: str, group_size: int) -> SinkTurboCodec:
    """The shared codec for a registered mode (see tierkv.codecs.SINK_MODES) and group size."""
    bits, centred = SINK_MODES[name]
    return SinkTurboCodec(name, group_size, bits, centred)


def body_bytes(header: PayloadHeader, body: memoryview) -> int:
    """The body length a payload with `header` and this body's prefix must have."""
    try:
        check_group_size(header.codec, header.group_size)
    except ValueError as exc:
        raise PayloadError(f"invalid payload header: {exc}") from None
    if header.size % header.group_size:
        raise PayloadError(
            f"invalid {header.codec} payload header: {header.size} values is not a whole number "
            f"of {header.group_size}-value vectors"
        )
    named_codec(header.codec, header.group_size).parts(header, np.frombuffer(body, np.uint8))
    return len(body)


def decode_body(header: PayloadHeader, body: np.ndarray, out_words: np.ndarray) -> None:
    """Decode a body (its length checked by body_bytes) into `out_words`."""
    named_codec(header.codec, header.group_size).decode_words(header, body, out_words)


FAMILY = CodecFamily(
    names=tuple(SINK_MODES),
    make=named_codec,
    body_bytes=body_bytes,
    decode_body=decode_body,
)
"""The key-aware modes (tierkv.codecs.SINK_MODES), for tierkv.quant.codec."""
